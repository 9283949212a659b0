"""The base config: a default for every key, loading of config files, overrides, validation.

Every experiment config starts from `base_config()` and changes what it needs; keys that the base
does not have are errors (the ConfigDict is locked). docs/config.md documents every key.

    config = load_config("configs/tiny.py:cpu", ["--config.train.steps=10"])
"""

from __future__ import annotations

import ast
import copy
import difflib
import importlib.util
import math
import os
from typing import Any, Sequence

import ml_collections

MESH_AXES = ("data", "pipe", "fsdp", "expert", "seq", "tensor")
REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16")
SCHEDULES = ("cosine", "wsd", "constant")
ATTENTION_IMPLS = ("reference", "pallas", "cudnn")
ATTENTION_KERNELS = ("auto", "generic", "tpu", "mosaic_gpu")  # config.model.attention_kernel
CONTEXT_PARALLEL = ("ring", "allgather", "tokenring")
LAYER_TYPES = ("softmax", "local", "linear")  # local: softmax over a sliding window
MLP_TYPES = ("dense", "moe")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # config.model.mlp_activation: the gated MLP's (SwiGLU, GeGLU)
MOE_ROUTERS = ("softmax", "sigmoid")
MOE_GROUP_SCORES = ("max", "top2")  # config.model.moe.group_score: DeepSeek-V2's, DeepSeek-V3's
EXPERT_DISPATCH = ("padded", "ragged")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b")
OPTIMIZERS = ("adamw", "galore", "muon", "zo", "sgd")
OBJECTIVES = ("lm", "dpo")  # config.train.objective (docs/finetune.md)
# config.lora.targets: attention, the dense MLP, and MLA's projections (models/mla.py)
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "wq_a", "wq_b", "wkv_a", "wk_rope", "wk_b", "wv_b")
OPTIMIZER_UPDATE = ("device", "host")
QUANT_FORMATS = ("none", "w8a16", "w4a16", "w8a8", "w4a8", "w4a4")  # config.model.quant (docs/quantization.md)
QUANT_TRAIN = ("none", "int8", "fp8")  # config.model.quant_train
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # config.model.rope_scaling (models/layers.py RopeScaling)
QUANT_IMPLS = ("pallas", "reference")
QUANT_GROUP_SIZES = (32, 64, 128)
SERVE_POLICIES = ("chunked", "prefill_first", "decode_first")  # config.serve.policy
MLA_CACHES = ("latent", "expanded")  # config.model.mla.cache (docs/mla.md)
KV_QUANT = ("none", "int8", "kivi4", "kivi2")  # config.serve.kv_quant (docs/kv_quant.md)
CACHE_KINDS = ("paged", "contiguous")  # config.serve.cache (jaxsys/cache/)
# checkpoint_name()s the model puts on activations, which config.offload.activations may offload
ACTIVATION_NAMES = ("layer_input", "attention_output", "mlp_hidden")
MODEL_KINDS = ("jaxsys", "flax")  # config.model.kind (docs/flax.md)
RESIDUALS = ("standard", "ladder")  # config.model.residual (docs/comm_overlap.md)
FREE_FORM = "model.flax_kwargs."  # keys under it are the Flax module's own, not the base config's


class ConfigError(ValueError):
    """A config that cannot run: the message names the key and says what to do."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 256  # V
    c.model.d_model = 128  # D
    c.model.n_layers = 2  # L
    c.model.n_heads = 4  # N
    c.model.n_kv_heads = 2  # K
    c.model.head_dim = 32  # H
    c.model.d_ff = 512  # F
    c.model.rope_theta = 10000.0
    # RoPE for a context beyond the trained one (Hugging Face's rope_type): none | linear | llama3
    # (Llama 3.1-3.3's) | yarn (Qwen2.5 / Qwen3 long context), with factor, the original context
    # (llama3, yarn), llama3's frequency band, yarn's ramp (beta_fast / beta_slow rotations) and
    # attention factor (0: 0.1 ln(factor) + 1)
    c.model.rope_scaling = "none"
    c.model.rope_factor = 1.0
    c.model.rope_low_freq_factor = 1.0
    c.model.rope_high_freq_factor = 4.0
    c.model.rope_original_max_position = 8192
    c.model.rope_beta_fast = 32.0
    c.model.rope_beta_slow = 1.0
    c.model.rope_attention_factor = 0.0
    c.model.rope_truncate = True
    c.model.norm_eps = 1e-5
    # RMSNorm over each head's q and k (a learned [H] scale each) before RoPE: Qwen3, OLMo 2, Gemma 3
    c.model.qk_norm = False
    # biases on the q, k and v projections (Qwen2 / Qwen2.5); o and the MLP stay without
    c.model.qkv_bias = False
    # Gemma's pieces: embeddings times sqrt(D); the gated MLP's activation (silu: SwiGLU,
    # gelu_tanh: GeGLU); an RMSNorm on each sublayer's output before the residual add (Gemma 2 / 3);
    # the softmax scale query_pre_attn_scalar^-0.5 (0: head_dim's); the RoPE base of the local
    # layers, unscaled (Gemma 3: 10000; 0: rope_theta with rope_scaling, as the other layers)
    c.model.embed_scale = False
    c.model.mlp_activation = "silu"
    c.model.post_norms = False
    c.model.query_pre_attn_scalar = 0.0
    c.model.rope_local_theta = 0.0
    # Gemma 2's logit soft-capping, c * tanh(x / c) (0: off): of each attention score after
    # scaling, before the mask and softmax (50 in Gemma 2), and of the output logits (30)
    c.model.attn_logit_softcap = 0.0
    c.model.final_logit_softcap = 0.0
    # Multi-head latent attention (DeepSeek-V2 / V3; docs/mla.md): keys and values come from a
    # latent of kv_lora_rank C per token (0: MLA off, the usual q/k/v projections), queries from one
    # of q_lora_rank Q (0: projected from x directly, as DeepSeek-V2-Lite). Each q/k head of head_dim
    # H has its last rope_head_dim R dims rotated, k's R shared by every head; values have v_head_dim
    # H_v <= H (0: H). Needs n_kv_heads = n_heads (every head its own k and v from the latent).
    c.model.mla = ml_collections.ConfigDict()
    c.model.mla.kv_lora_rank = 0
    c.model.mla.q_lora_rank = 0
    c.model.mla.rope_head_dim = 64
    c.model.mla.v_head_dim = 0
    # what a serving cache holds per token: "latent", MLA's C + R row (queries absorb W_k_b, the
    # output W_v_b: DeepSeek-V2's inference form), or "expanded", every head's keys and values
    c.model.mla.cache = "latent"
    # Multi-token prediction (DeepSeek-V3; models/mtp.py, docs/mtp.md): `depth` D_m sequential
    # modules, module k predicting the token k + 1 ahead from the previous depth's hidden state and
    # the embedding of token i + k; their mean cross-entropy times `loss_weight` (lambda: V3 used
    # 0.3, then 0.1) joins the objective. Training only; 0: off.
    c.model.mtp = ml_collections.ConfigDict()
    c.model.mtp.depth = 0
    c.model.mtp.loss_weight = 0.3
    c.model.tie_embeddings = False
    c.model.init_std = 0.02
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "float32"
    c.model.remat = "none"
    c.model.attention_impl = "reference"  # reference | pallas | cudnn (GPU)
    c.model.layer_pattern = "softmax"  # comma-separated layer types repeated over the layers
    # W of the "local" layers (sliding-window attention: a query sees its last W keys, its own
    # included; Mistral v0.1, Qwen2's upper layers, Gemma's local layers); 0 without such layers
    c.model.sliding_window = 0
    # attention_impl='pallas': which flash kernel. auto: by the platform lowered for (Mosaic on TPU,
    # the Mosaic GPU kernels on a Hopper GPU for the shapes they take, Triton elsewhere); generic:
    # Triton (interpret mode on CPU); tpu; mosaic_gpu (Hopper; refused for shapes it does not take)
    c.model.attention_kernel = "auto"
    c.model.attention_block = 0  # Pallas flash attention tile (queries and keys); 0: the tuning cache, else 128
    c.model.linear_chunk = 64  # chunk of the linear-attention layers
    c.model.context_parallel = "ring"  # ring | allgather | tokenring (softmax layers, mesh.seq > 1)
    c.model.context_load_balance = True  # zigzag chunks so causal work is even over seq
    c.model.mlp_pattern = "dense"  # comma-separated MLP types (dense | moe) repeated over the layers
    # standard | ladder. Ladder residual (Zhang et al. 2025; docs/comm_overlap.md): each attention or
    # MLP module reads the residual stream without the previous module's output, which is added one
    # module later, so its tensor-parallel all-reduce can overlap the next module's compute. A
    # different architecture (not a layout): losses differ from "standard". No pipeline (mesh.pipe 1).
    c.model.residual = "standard"
    # Quantized dense layers (docs/quantization.md). `quant`: the format of a quantized checkpoint's
    # weights (written by `python -m jaxsys.quantize`; inference only), run through the Pallas kernels
    # (`quant_impl='reference'`: the same integer semantics in plain XLA). `quant_train='int8'`:
    # training with int8 forward and backward matmuls and a straight-through estimator; 'fp8': e4m3
    # forward and e5m2 gradient matmuls with current per-tensor scales, fp32 master weights.
    c.model.quant = "none"  # none | w8a16 | w4a16 | w8a8 | w4a8 | w4a4
    c.model.quant_group_size = 128  # G of the 4-bit formats: k per scale (32 | 64 | 128); the rotation's block
    c.model.quant_zero_point = False  # 4-bit weights with a zero point per group (asymmetric codes)
    c.model.quant_rotate = False  # weights stored as H W, activations rotated by H (block Hadamard of G)
    c.model.quant_impl = "pallas"  # pallas | reference
    c.model.quant_train = "none"  # none | int8 | fp8
    # Bring your own Flax NNX model (docs/flax.md): kind "flax" trains flax_module
    # ("package.module:ClassName", built as ClassName(**flax_kwargs, rngs=nnx.Rngs(key))) in place of
    # the transformer, whose shape keys then do not apply (vocab_size does: the width of its logits).
    c.model.kind = "jaxsys"  # jaxsys | flax
    c.model.flax_module = ""
    c.model.flax_kwargs = ml_collections.ConfigDict()  # the module's constructor arguments (free-form)

    # Mixture of experts (the layers that mlp_pattern marks `moe`; docs/moe.md)
    c.model.moe = ml_collections.ConfigDict()
    c.model.moe.experts = 8  # E routed experts per MoE layer
    c.model.moe.top_k = 2  # k experts per token
    c.model.moe.d_ff = 256  # F_e, hidden units of one expert (SwiGLU)
    c.model.moe.shared_experts = 0  # always-on experts of d_ff units each, run as one dense SwiGLU
    # the shared experts' output times sigmoid(h w_g) per token, w_g [D] a layer (Qwen2-MoE's gate)
    c.model.moe.shared_expert_gate = False
    c.model.moe.router = "softmax"  # softmax | sigmoid scores
    c.model.moe.renormalize = True  # the k gates of a token sum to 1
    c.model.moe.capacity_factor = 0.0  # 0: dropless (ragged_dot); > 0: C = ceil(cf k T / E) per sequence
    c.model.moe.aux_loss_weight = 0.01  # load-balancing loss E sum_e f_e P_e (Switch)
    c.model.moe.z_loss_weight = 0.001  # router z-loss mean(logsumexp(logits)^2) (ST-MoE)
    # DeepSeek's routing (docs/moe.md): the k gates times routed_scale (routed_scaling_factor);
    # group-limited choice with groups > 1: the E experts in equal groups, each token choosing
    # among the experts of its group_top_k best groups, a group scored by its best expert
    # (group_score='max', DeepSeek-V2) or its best two summed ('top2', DeepSeek-V3); score_bias: a
    # per-expert bias added to the scores for the choice only, not the gates (DeepSeek-V3's
    # auxiliary-loss-free balancing), moved by bias_update_rate u after each step: b_e += u
    # sign(mean load - load_e) (0: fixed, as a converted checkpoint's)
    c.model.moe.routed_scale = 1.0
    c.model.moe.groups = 1
    c.model.moe.group_top_k = 1
    c.model.moe.group_score = "max"
    c.model.moe.score_bias = False
    c.model.moe.bias_update_rate = 0.0

    c.data = ml_collections.ConfigDict()
    c.data.source = "stdlib"
    c.data.path = ""
    c.data.token_dtype = "uint16"
    c.data.seq_len = 128  # T
    c.data.eval_fraction = 0.01
    # Document corpora (source jsonl | parquet | hf; docs/data.md): tokenized once into shards
    c.data.format = "text"  # text: one document per record | chat: a list of messages (SFT)
    c.data.text_field = "text"  # the record's field holding a document's text (format text)
    c.data.messages_field = "messages"  # ... holding a chat's [{"role", "content"}] (format chat)
    c.data.split = "train"  # the split of an hf DatasetDict saved to disk
    c.data.tokenizer = "bytes"  # bytes | a Hugging Face tokenizer directory or tokenizer.json
    c.data.cache_dir = ""  # where the tokenized shards go ("": $JAXSYS_CACHE/corpora)
    c.data.shard_docs = 10000  # documents per shard (the unit of parallel and resumable work)
    c.data.tokenize_workers = 0  # worker processes of the tokenize command (0: up to 8, one per core)
    c.data.packing = False  # several documents per row with segment ids (False: one per row, padded)
    c.data.adaptive_cp = False  # packed rows laid out so short documents sit on one seq device (docs/bytescale.md)
    c.data.adaptive_cp_local = 0.0  # with adaptive_cp: share of each seq device's tokens attended locally (no ring)
    c.data.adaptive_cp_buckets = ""  # with adaptive_cp: local shares, one program each, chosen per batch ("0,0.5")
    c.data.adaptive_cp_groups = ""  # with adaptive_cp: "g:share,...", tiers of rings within groups of g seq devices
    c.data.prefetch = 2  # batches the loader builds ahead of the step (grain threads)

    c.train = ml_collections.ConfigDict()
    c.train.steps = 100
    c.train.batch_size = 16  # B, global, in sequences
    c.train.zero_stage = 0
    c.train.log_every = 10
    c.train.eval_every = 0  # 0: evaluate only at the end
    c.train.eval_batches = 4
    c.train.lr = 3e-3
    c.train.schedule = "cosine"
    c.train.warmup_steps = 10
    c.train.decay_fraction = 0.2  # wsd: fraction of steps spent decaying
    c.train.min_lr_ratio = 0.1
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.eps = 1e-8
    c.train.grad_clip = 1.0  # 0 disables clipping
    c.train.progress = True
    c.train.microbatches = 1  # m: the local batch is split into m micro-batches (pipeline, or accumulation)
    c.train.pipeline_schedule = "1f1b"  # gpipe | 1f1b | eager_1f1b | interleaved_1f1b (mesh.pipe > 1)
    c.train.virtual_stages = 1  # v: model chunks per pipe device (interleaved_1f1b)
    # adamw | galore (AdamW on low-rank projected gradients) | muon (orthogonalized momentum for the
    # hidden matrices, AdamW for the rest) | zo (MeZO) | sgd
    c.train.optimizer = "adamw"
    # GaLore (Zhao et al. 2024): the 2-D weight gradients of the named leaves are projected to rank r
    c.train.galore = ml_collections.ConfigDict()
    c.train.galore.rank = 8  # r
    c.train.galore.update_every = 200  # K: steps between refreshes of the projection (SVD)
    c.train.galore.scale = 0.25  # alpha: the projected-back update is scaled by it
    c.train.galore.leaves = "wq,wk,wv,wo,w_gate,w_up,w_down"  # comma-separated leaf names
    # Muon (jaxsys/optim/muon.py, docs/muon.md): the named matrices' momentum orthogonalized by
    # Newton-Schulz; consistent_rms 0.2 scales the update to AdamW's RMS (Moonlight), so train.lr
    # and train.weight_decay carry over (0: Keller Jordan's sqrt(max(1, fan_out / fan_in)))
    c.train.muon = ml_collections.ConfigDict()
    c.train.muon.beta = 0.95  # momentum
    c.train.muon.nesterov = True
    c.train.muon.ns_steps = 5  # Newton-Schulz iterations
    c.train.muon.consistent_rms = 0.2
    c.train.muon.leaves = "wq,wk,wv,wo,w_gate,w_up,w_down"  # comma-separated leaf names; the rest: AdamW
    # DiLoCo (Douillard et al. 2023; jaxsys/optim/outer.py, docs/diloco.md): the `data` ranks are islands
    # that each take `every` (H) inner steps of train.optimizer on their own batch shard with no
    # cross-island reduction, then average their outer gradients (params before - after) and take one
    # Nesterov-SGD outer step. e.g. --config.train.outer.method=diloco --config.train.outer.every=50
    c.train.outer = ml_collections.ConfigDict()
    c.train.outer.method = "none"  # none | diloco | co2 (the outer update one round late, CO2)
    c.train.outer.every = 50  # H: inner steps between two synchronisations of a fragment
    c.train.outer.lr = 0.7  # outer learning rate (DiLoCo's 0.7)
    c.train.outer.momentum = 0.9  # outer momentum (0: plain SGD)
    c.train.outer.nesterov = True
    c.train.outer.fragments = 1  # P > 1: Streaming DiLoCo, fragment p (layers p, p+P, ...) syncs H/P steps after p-1
    c.train.outer.quantize = "none"  # none | int8 | int4: outer gradients quantized before the average
    c.train.outer.error_feedback = False  # quantized: each island adds its last quantization residual to the next
    # Streaming DiLoCo's overlap: a fragment's average (of the deltas at step s) is applied tau steps later,
    # where each island keeps merge * its own + (1 - merge) * the new global (alpha; 0: take the global)
    c.train.outer.overlap_steps = 0  # tau, < every (0: synchronous)
    c.train.outer.merge = 0.0  # alpha in [0, 1)
    # CO2's stabilisers (docs/diloco.md states the equations)
    c.train.outer.co2_penalty = False  # staleness gap penalty: the stale outer gradient / (1 + |gap| / |lr Delta|)
    c.train.outer.momentum_clip = 0.0  # > 0: the outer momentum's L2 norm clipped to this (0: off)
    # Zeroth-order SGD (MeZO, Malladi et al. 2023): two forwards at theta +- eps z, z from a seed
    c.train.zo = ml_collections.ConfigDict()
    c.train.zo.eps = 1e-3  # perturbation scale
    # lm: next-token cross-entropy (weighted by the batch's loss weights); dpo: Direct Preference
    # Optimization on chosen/rejected pairs (config.data.format='preference'; docs/finetune.md)
    c.train.objective = "lm"
    c.train.dpo = ml_collections.ConfigDict()
    c.train.dpo.beta = 0.1  # beta: the strength of the KL tie to the reference model
    # "a:b": a JAX profiler trace of steps a..b (1-based, inclusive) into {workdir}/tb/plugins/profile
    c.train.profile_steps = ""
    # In-memory snapshots and elastic restart (docs/fault_tolerance.md): every `every` steps each
    # process writes its unique shards, the loader position and the step to host memory and sends a
    # replica of its shards to process (p + 1) % P; a restart resumes from the newest complete one.
    c.train.snapshot = ml_collections.ConfigDict()
    c.train.snapshot.every = 0  # k; 0 = off
    c.train.snapshot.dir = ""  # "" = /dev/shm/jaxsys-snapshots/<hash of the workdir> (RAM on Linux)
    c.train.snapshot.keep = 2  # complete snapshots kept
    c.train.snapshot.peer_timeout_s = 10.0  # multi-process: a peer silent this long -> PeerLost, exit 75
    c.train.snapshot.elastic = True  # resume on a device count the mesh does not fit: the planner's layout

    # LoRA / QLoRA (Hu et al. 2021; Dettmers et al. 2023; docs/finetune.md): low-rank adapters on the
    # dense projections, trained with the base frozen (a quantized base, config.model.quant, is QLoRA)
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0  # r; 0 = off
    c.lora.alpha = 16.0  # the adapter's output is scaled by alpha / r
    # comma-separated projections of every layer (those a model lacks are skipped; MLA's: wq_a,
    # wq_b, wkv_a, wk_rope, wk_b, wv_b)
    c.lora.targets = "wq,wk,wv,wo,w_gate,w_up,w_down"
    c.lora.dropout = 0.0  # dropout on the adapter's input (training only)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.enabled = True
    c.checkpoint.every_steps = 1000  # 0: only by time and at the end
    c.checkpoint.every_minutes = 0.0  # 0: not by time
    c.checkpoint.keep = 3  # last N kept; 0 keeps all
    c.checkpoint.keep_period = 0  # also keep every k-th step for good; 0: none
    c.checkpoint.async_save = True
    c.checkpoint.init_from = ""  # a workdir (or checkpoints dir) whose latest parameters start a new run

    # Host offloading (docs/offload.md): state in host memory (memory kind pinned_host)
    c.offload = ml_collections.ConfigDict()
    c.offload.optimizer = False  # optimizer state lives in host memory
    c.offload.optimizer_update = "device"  # device: stream the state in and out | host: update on the host
    c.offload.optimizer_fraction = 1.0  # share of the optimizer-state bytes offloaded, leaf by leaf
    c.offload.params = False  # parameters (shards) live in host memory; each layer's moves in before use
    c.offload.activations = ""  # comma-separated ACTIVATION_NAMES saved to host instead of recomputed

    # Devices per mesh axis; one axis may be -1: whatever the device count leaves (so that one config
    # runs on a laptop, a node and a pod, as MaxText's -1 parallelism does).
    c.mesh = ml_collections.ConfigDict({axis: 1 for axis in MESH_AXES})
    # Of config.mesh.<axis>, the factor that spans TPU slices (multi-slice) or hosts (GPU clusters):
    # those hops run over the data-centre network (DCN), the rest over ICI / NVLink. The product is
    # the number of slices (or hosts); 1 everywhere is one slice.
    c.dcn = ml_collections.ConfigDict({axis: 1 for axis in MESH_AXES})

    c.parallel = ml_collections.ConfigDict()
    c.parallel.sequence_parallel = False  # Megatron SP in the norm/residual regions
    # with SP: the all-gather / reduce-scatter over T beside the TP matmuls split into ppermute steps
    # that overlap the partial matmuls (docs/comm_overlap.md); needs tensor > 1 and sequence_parallel
    c.parallel.collective_matmul = False
    c.parallel.vocab_parallel = False  # embedding and output layer split over the pipe stages too
    c.parallel.expert_dispatch = "padded"  # padded | ragged (ragged_all_to_all; GPU/TPU only)
    c.parallel.expert_rebalance_every = 0  # re-place experts on devices every N steps by their load; 0: never
    c.parallel.expert_colocate = True  # rebalancing also co-locates experts consecutive layers route to together
    c.parallel.fsdp_prefetch = False  # all-gather layer i+1's FSDP weights while layer i computes
    # ZeRO++ (docs/zeropp.md); need sharding.params.embed = "fsdp,data" (ZeRO-3 over every rank):
    # hpZ: the layers gather over `fsdp` only, from a secondary copy gathered over `data` once a step
    c.parallel.zeropp_hpz = False
    c.parallel.zeropp_qwz = False  # hpZ's `data` all-gather in int8 (row-wise absmax), dequantized after
    c.parallel.zeropp_qgz = False  # hpZ's `data` gradient reduce-scatter as an int8 all-to-all, summed in fp32
    c.parallel.zeropp_qgz_bits = 8  # 8 | 4: qgZ's codes (4: packed two to a byte)
    # pipeline sends issued outside the per-tick conds, beside the other compute (a tick's activations
    # beside its backward, its gradients beside the next tick's forward); every tick then sends, zeros
    # when idle: +15-50% transfers for the 1F1B schedules, +100% and nothing hidden for gpipe
    # (docs/comm_overlap.md). Same numerics. Needs mesh.pipe > 1
    c.parallel.pipeline_overlap = False

    # Logical axis -> mesh axis ("" = replicated). `params` is where parameters live at rest;
    # `compute` is where they are used (FSDP is the difference: embed is gathered before use).
    c.sharding = ml_collections.ConfigDict()
    c.sharding.params = ml_collections.ConfigDict(
        dict(
            layers="pipe",
            embed="fsdp",
            vocab="tensor",
            heads="tensor",
            kv_heads="tensor",
            head_dim="",
            latent="fsdp",
            mlp="tensor",
            experts="expert",
        )
    )
    c.sharding.compute = ml_collections.ConfigDict(
        dict(
            layers="pipe",
            embed="",
            vocab="tensor",
            heads="tensor",
            kv_heads="tensor",
            head_dim="",
            latent="",
            mlp="tensor",
            experts="expert",
            batch="data,fsdp,expert",
            seq="seq",
        )
    )

    # Serving (docs/serving.md): the engine's KV cache and continuous batching, per batch shard
    c.serve = ml_collections.ConfigDict()
    c.serve.cache = "paged"  # paged | contiguous (a row of max_len slots per running sequence)
    c.serve.allocation = "on_demand"  # on_demand (pages as sequences grow; preemption) | reserve (prompt + max_new)
    c.serve.prefix_cache = True  # share full pages between requests by the hash chain of their tokens
    # a model whose every layer is `local` (sliding window W): each sequence holds only the pages of
    # its last W positions and a step's tokens, reused in a ring (no prefix cache then)
    c.serve.rolling = True
    c.serve.ragged = True  # a step's rows attend per sequence with the ragged paged-attention kernel
    c.serve.decode_steps = 1  # > 1: decode steps in one compiled call when only decodes run (multi-step)
    # overlapped scheduling: step n + 1 is planned and dispatched while the device runs step n
    # (its tokens stay on the device, the host reads them a step late; docs/serving.md)
    c.serve.overlap = False
    # recompute (a preempted sequence prefills again) | swap (its pages go to host memory and back)
    c.serve.preemption = "recompute"
    c.serve.pages = 256  # pages in a batch shard's KV pool
    c.serve.page_size = 16  # token slots per page
    c.serve.token_budget = 256  # tokens per engine step (decodes + prefill chunks)
    c.serve.chunk_size = 64  # prefill chunk (Sarathi-Serve)
    c.serve.max_seqs = 16  # sequences running at once
    c.serve.policy = "chunked"  # chunked | prefill_first | decode_first
    c.serve.kv_quant = "none"  # none | int8 | kivi4 | kivi2: the engine's KV cache format (docs/kv_quant.md)
    c.serve.kv_residual = 0  # full pages kept in full precision before each sequence's open page
    # disaggregated prefill and decode (serve/disagg.py): two sub-meshes over disjoint devices
    c.serve.disaggregate = False
    c.serve.prefill_mesh = "tensor=4"  # axis sizes of the prefill sub-mesh ("axis=size,...")
    c.serve.decode_mesh = "data=2,tensor=2"  # ... and of the decode sub-mesh; together all devices
    c.serve.placement = "cost"  # cost (the cost model picks per request) | prefill | colocated
    c.serve.interference = 1.0  # cost model: weight of the running decodes' stall vs one request's TTFT
    c.serve.hardware = "h100"  # cost model: the hardware profile placement is priced on
    # speculative decoding in the engine (serve/speculation.py): tokens drafted per decode step
    c.serve.spec_k = 0  # 0 = off
    c.serve.draft = "none"  # none | a workdir of a smaller model with the same vocabulary | self
    c.serve.spec_window = 64  # self-speculation: the draft attends to the last spec_window tokens
    c.serve.spec_sink = 4  # ... and to the first spec_sink (attention sinks); both in whole pages

    # RL post-training (GRPO; docs/rl.md, jaxsys/rl/): jaxsys.train runs it when task is not "none".
    # train.batch_size = prompts x group_size samples per update; data.seq_len >= prompt + max_new_tokens
    c.rl = ml_collections.ConfigDict()
    c.rl.task = "none"  # none | reverse | sort | add (jaxsys/rl/tasks.py)
    c.rl.task_length = 3  # letters (reverse, sort) or digits (add) of a prompt
    c.rl.group_size = 8  # G samples per prompt
    c.rl.max_new_tokens = 6  # tokens a completion may have
    c.rl.temperature = 1.0  # rollouts sample at 1 (the engine's log-probabilities are then the behaviour policy's)
    c.rl.clip = 0.2  # PPO clip range of the importance ratio
    c.rl.kl = 0.02  # beta, the weight of the KL term to the frozen reference
    c.rl.steps = 100  # policy updates
    c.rl.warmup_steps = 0  # supervised steps on the task's format before RL (a brief SFT)
    c.rl.warmup_right = 0.0  # ... the fraction of its examples with the right answer (else random ones)
    c.rl.mode = "sync"  # sync | async (the generator runs ahead with weights up to `staleness` old)
    c.rl.staleness = 1  # async: k, the most versions a rollout's weights may lag the trainer's
    c.rl.placement = "colocated"  # colocated (take turns on all devices) | disaggregated
    c.rl.trainer_mesh = ""  # disaggregated: the trainer's axis sizes ("fsdp=4"); colocated: config.mesh
    c.rl.generator_mesh = ""  # the generator's ("data=2,tensor=2"); "" = the trainer's layout
    c.rl.trainer_devices = ""  # device ids ("0-3" or "0,1,2,3"); "" = the first ones
    c.rl.generator_devices = ""  # ""  = the ones after the trainer's (disaggregated), all (colocated)
    c.rl.plan_hardware = ""  # a hardware profile (h100, cpu, ...): placement, split and layouts by the
    # iteration-time model (analysis/rl.py) instead of rl.placement / trainer_mesh / generator_mesh
    c.rl.eval_prompts = 64  # greedy evaluation prompts (fixed) every log_every updates

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""  # "" = from the environment, or single process
    c.distributed.num_processes = 0
    c.distributed.process_id = -1

    c.hardware = ml_collections.ConfigDict()
    c.hardware.peak_flops = 0.0  # FLOP/s of the whole job for MFU; 0 = detect

    # JAX's persistent compilation cache (jaxsys/compile_cache.py, docs/goodput.md): a restart or a
    # second run of the same config loads its compiled programs instead of compiling them again
    c.compile_cache = ml_collections.ConfigDict()
    c.compile_cache.dir = "auto"  # auto: $JAXSYS_COMPILE_CACHE, else $JAXSYS_CACHE/xla (~/.cache/jaxsys/xla); "": off
    c.compile_cache.min_compile_secs = 0.0  # programs compiled faster than this are not written

    return c


# ----------------------------------------------------------------------------- loading


def load_config(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """Load `path/to/config.py[:arg]` (or a resolved `config.json` that a run or `jaxsys.convert`
    wrote), apply `--config.key=value` overrides, validate."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist: pass --config configs/<name>.py")
    if path.endswith(".json"):
        config = from_dict(_read_json(path), source=path)
        apply_overrides(config, overrides)
        validate(config)
        return config
    module_spec = importlib.util.spec_from_file_location("jaxsys_user_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} has no get_config(arg=None) function")
    config = module.get_config(arg or None)
    check_keys(config)
    apply_overrides(config, overrides)
    validate(config)
    return config


def _read_json(path: str) -> dict:
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config file {path!r} is not readable JSON ({e})") from e


def from_dict(values: dict, source: str = "a dict") -> ml_collections.ConfigDict:
    """The base config with every key of a resolved config (nested dict) set from `values`;
    a key the base does not know is an error naming it."""
    config = base_config()
    known = _flatten(config)
    flat = _flatten(ml_collections.ConfigDict(values))
    kwargs = values.get("model", {}).get("flax_kwargs")  # free-form: the Flax module's arguments
    if kwargs:
        config.model.flax_kwargs = ml_collections.ConfigDict(kwargs)
    flat = {k: v for k, v in flat.items() if not k.startswith(FREE_FORM)}
    for key, value in flat.items():
        if key not in known:
            raise ConfigError(f"{source}: " + str(_unknown_key_error(key, list(known))))
        parent = config
        *path, leaf = key.split(".")
        for part in path:
            parent = parent[part]
        if isinstance(known[key], float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        with parent.unlocked():
            parent[leaf] = value
    return config


def _flatten(config, prefix="") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


# Keys by which users (and issue 35's text) may know a setting that jaxsys names otherwise
_OTHER_NAMES = {"model.matmul_dtype": "model.quant_train ('fp8': e4m3 / e5m2 training matmuls; 'int8')"}


def _unknown_key_error(key: str, known: Sequence[str]) -> ConfigError:
    close = [_OTHER_NAMES[key]] if key in _OTHER_NAMES else difflib.get_close_matches(key, known, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key 'config.{key}'.{hint} Every key is listed in docs/config.md.")


def check_keys(config) -> None:
    """Every key must exist in the base config (catches typos in config files)."""
    known = _flatten(base_config())
    for key in _flatten(config):
        if key not in known and not key.startswith(FREE_FORM):
            raise _unknown_key_error(key, list(known))


def _parse_value(key: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"config.{key} expects true/false, got {text!r}")
    if isinstance(default, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"config.{key} expects a {type(default).__name__}, got {text!r}") from None
    if isinstance(default, float) and isinstance(value, int):
        value = float(value)
    if not isinstance(value, type(default)):
        raise ConfigError(f"config.{key} expects a {type(default).__name__}, got {text!r}")
    return value


def parse_with_overrides(parser, argv, example: str = "--config.mesh.tensor=2"):
    """`parser.parse_known_args(argv)` whose unknown arguments must all be `--config.k=v`
    overrides (returned as the second value); anything else is the parser's usage error."""
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides look like {example}")
    return args, overrides


def apply_overrides(config, overrides: Sequence[str]) -> None:
    """Apply `--config.a.b=value` (or `config.a.b=value`) strings in place."""
    known = _flatten(config)
    for item in overrides:
        body = item.lstrip("-")
        if not body.startswith("config.") or "=" not in body:
            raise ConfigError(f"override {item!r} must look like --config.train.steps=100")
        key, _, text = body[len("config.") :].partition("=")
        if key not in known:
            raise _unknown_key_error(key, list(known))
        parent = config
        *path, leaf = key.split(".")
        for part in path:
            parent = parent[part]
        with parent.unlocked():
            parent[leaf] = _parse_value(key, text, known[key])


# ----------------------------------------------------------------------------- validation


def layer_pattern(model) -> tuple[str, ...]:
    """`model.layer_pattern` "linear, linear,softmax" -> ("linear", "linear", "softmax")."""
    return tuple(p.strip() for p in model.layer_pattern.split(",") if p.strip())


def mlp_pattern(model) -> tuple[str, ...]:
    """`model.mlp_pattern` "dense,moe" -> ("dense", "moe")."""
    return tuple(p.strip() for p in model.mlp_pattern.split(",") if p.strip())


def block_pattern(model) -> tuple[tuple[str, str], ...]:
    """(attention type, MLP type) of each layer of one period of the model: the layer and MLP
    patterns repeat together with period lcm(len(layer_pattern), len(mlp_pattern))."""
    attn, mlp = layer_pattern(model), mlp_pattern(model)
    period = math.lcm(len(attn), len(mlp))
    return tuple((attn[i % len(attn)], mlp[i % len(mlp)]) for i in range(period))


def axes_of(rule: str) -> tuple[str, ...]:
    """'data,fsdp' -> ('data', 'fsdp'); '' -> ()."""
    return tuple(a.strip() for a in rule.split(",") if a.strip())


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_gemma_pieces(m) -> None:
    """config.model.embed_scale / mlp_activation / post_norms / query_pre_attn_scalar /
    rope_local_theta / attn_logit_softcap / final_logit_softcap."""
    _require(
        m.mlp_activation in MLP_ACTIVATIONS,
        f"config.model.mlp_activation={m.mlp_activation!r}: choose one of {MLP_ACTIVATIONS}",
    )
    _require(
        m.mlp_activation == "silu" or "moe" not in mlp_pattern(m),
        f"config.model.mlp_activation={m.mlp_activation!r}: the MoE experts are SwiGLU; use 'silu' with moe layers",
    )
    for key in ("query_pre_attn_scalar", "rope_local_theta", "attn_logit_softcap", "final_logit_softcap"):
        value = m[key]
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
            f"config.model.{key}={value!r} must be a number >= 0 (0: off)",
        )
    _require(
        not m.rope_local_theta or "local" in layer_pattern(m),
        f"config.model.rope_local_theta={m.rope_local_theta} is the RoPE base of 'local' layers, but "
        f"config.model.layer_pattern={m.layer_pattern!r} has none: set it to 0",
    )
    _require(
        not m.attn_logit_softcap or m.attention_impl != "cudnn",
        f"config.model.attn_logit_softcap={m.attn_logit_softcap} with config.model.attention_impl='cudnn': "
        "cuDNN's attention has no score soft-capping; use attention_impl='pallas' (the flash kernels cap "
        "in-kernel) or 'reference'",
    )


def _check_mla(m) -> None:
    """config.model.mla (multi-head latent attention, models/mla.py)."""
    mla = m.mla
    for key in ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "v_head_dim"):
        _require(
            isinstance(mla[key], int) and not isinstance(mla[key], bool) and mla[key] >= 0,
            f"config.model.mla.{key}={mla[key]!r} must be an integer >= 0",
        )
    _require(
        mla.cache in MLA_CACHES,
        f"config.model.mla.cache={mla.cache!r}: choose one of {MLA_CACHES} (what a serving cache holds per token)",
    )
    if not mla.kv_lora_rank:
        _require(
            not mla.q_lora_rank,
            f"config.model.mla.q_lora_rank={mla.q_lora_rank} compresses MLA's queries, but MLA is off "
            "(config.model.mla.kv_lora_rank=0): set kv_lora_rank > 0 (512 in DeepSeek-V2 / V3) or q_lora_rank=0",
        )
        return
    where = "with multi-head latent attention (config.model.mla.kv_lora_rank > 0)"
    _require(
        m.n_kv_heads == m.n_heads,
        f"config.model.n_kv_heads={m.n_kv_heads} {where}: every head has its own key and value from the "
        f"latent, so set n_kv_heads = n_heads = {m.n_heads}",
    )
    R = mla.rope_head_dim
    _require(
        R % 2 == 0 and 0 < R < m.head_dim,
        f"config.model.mla.rope_head_dim={R} must be even and between 0 and head_dim={m.head_dim} "
        "(the rotated tail of each q/k head; head_dim = nope + rope dims, 128 + 64 in DeepSeek-V3)",
    )
    _require(
        mla.v_head_dim <= m.head_dim,
        f"config.model.mla.v_head_dim={mla.v_head_dim} exceeds head_dim={m.head_dim}: values are padded "
        "to the q/k head for the attention kernels, so H_v <= H (0: H)",
    )
    _require(
        set(layer_pattern(m)) == {"softmax"},
        f"config.model.layer_pattern={m.layer_pattern!r} {where}: MLA layers are full softmax attention; "
        "use layer_pattern='softmax'",
    )
    for key in ("qk_norm", "qkv_bias"):
        _require(not m[key], f"config.model.{key}=True {where}: MLA has no such piece; set it False")
    _require(m.kind == "jaxsys", f"config.model.kind={m.kind!r} {where}: MLA is a jaxsys transformer's attention")


def _check_rope(m) -> None:
    """config.model.rope_scaling and its numbers (models/layers.py RopeScaling)."""
    _require(
        m.rope_scaling in ROPE_SCALINGS,
        f"config.model.rope_scaling={m.rope_scaling!r}: choose one of {ROPE_SCALINGS}",
    )
    if m.rope_scaling == "none":
        return
    _require(
        isinstance(m.rope_factor, (int, float)) and m.rope_factor > 0,
        f"config.model.rope_factor={m.rope_factor!r} must be > 0 (the context stretch, e.g. 8.0 for Llama 3.1)",
    )
    if m.rope_scaling == "llama3":
        _require(
            0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
            f"config.model.rope_low_freq_factor={m.rope_low_freq_factor} and rope_high_freq_factor="
            f"{m.rope_high_freq_factor}: need 0 < low < high (Llama 3.1: 1.0 and 4.0)",
        )
    if m.rope_scaling in ("llama3", "yarn"):
        _require(
            isinstance(m.rope_original_max_position, int) and m.rope_original_max_position > 0,
            f"config.model.rope_original_max_position={m.rope_original_max_position!r} must be a positive "
            "integer (the context the model was pre-trained at: 8192 for Llama 3.1, 32768 for Qwen3)",
        )
    if m.rope_scaling == "yarn":
        _require(
            0 < m.rope_beta_slow < m.rope_beta_fast,
            f"config.model.rope_beta_slow={m.rope_beta_slow} and rope_beta_fast={m.rope_beta_fast}: need "
            "0 < beta_slow < beta_fast (YaRN's defaults: 1.0 and 32.0)",
        )
        _require(
            isinstance(m.rope_attention_factor, (int, float)) and m.rope_attention_factor >= 0,
            f"config.model.rope_attention_factor={m.rope_attention_factor!r} must be >= 0 "
            "(0: YaRN's 0.1 ln(rope_factor) + 1)",
        )


def _validate_speculation(sv) -> None:
    """config.serve.spec_k / draft / spec_window / spec_sink (serve/speculation.py)."""
    _require(
        isinstance(sv.spec_k, int) and sv.spec_k >= 0,
        f"config.serve.spec_k={sv.spec_k!r} must be an integer >= 0 (0: no speculative decoding)",
    )
    _require(
        isinstance(sv.draft, str) and sv.draft != "",
        f"config.serve.draft={sv.draft!r}: 'none', 'self' or the workdir of a draft model",
    )
    _require(
        (sv.spec_k >= 1) == (sv.draft != "none"),
        f"config.serve.spec_k={sv.spec_k} with config.serve.draft={sv.draft!r}: speculation needs "
        "both a draft ('self' or a workdir) and spec_k >= 1, plain decoding spec_k=0 and draft='none'",
    )
    _require(
        isinstance(sv.spec_window, int) and sv.spec_window >= 1,
        f"config.serve.spec_window={sv.spec_window!r} must be a positive integer (tokens)",
    )
    _require(
        isinstance(sv.spec_sink, int) and sv.spec_sink >= 0,
        f"config.serve.spec_sink={sv.spec_sink!r} must be an integer >= 0 (tokens)",
    )


def fill_axis(config) -> str | None:
    """The mesh axis set to -1 (sized by the device count), or None."""
    filled = [a for a in MESH_AXES if config.mesh[a] == -1]
    return filled[0] if filled else None


def resolve_mesh(config, num_devices: int) -> None:
    """Set the -1 mesh axis (if any) to the device count over the other axes, in place."""
    axis = fill_axis(config)
    if axis is None:
        return
    others = math.prod(config.mesh[a] for a in MESH_AXES if a != axis)
    if num_devices % others:
        sizes = " x ".join(f"{a}={config.mesh[a]}" for a in MESH_AXES if a != axis and config.mesh[a] > 1)
        raise ConfigError(
            f"config.mesh.{axis}=-1 fills the devices, but {num_devices} devices do not "
            f"divide by the other axes ({sizes} = {others}): change those axes or the "
            "device count"
        )
    config.mesh[axis] = num_devices // others


def validate(config, num_devices: int | None = None) -> None:
    """Check everything that can be checked before any device work. `num_devices` is the
    global device count when known: a -1 mesh axis is resolved from it (in place) and the mesh
    product must equal it."""
    check_keys(config)
    m, mesh, t = config.model, config.mesh, config.train
    for axis in MESH_AXES:
        _require(
            isinstance(mesh[axis], int) and (mesh[axis] >= 1 or mesh[axis] == -1),
            f"config.mesh.{axis} must be a positive integer (or -1 for the devices the other axes "
            f"leave), got {mesh[axis]!r}",
        )
        _require(
            isinstance(config.dcn[axis], int) and config.dcn[axis] >= 1,
            f"config.dcn.{axis} must be a positive integer, got {config.dcn[axis]!r}",
        )
    filled = [a for a in MESH_AXES if mesh[a] == -1]
    _require(len(filled) <= 1, f"config.mesh: only one axis may be -1, got {', '.join(filled)}")
    if num_devices is not None:
        resolve_mesh(config, num_devices)
    for axis in MESH_AXES:
        _require(
            mesh[axis] == -1 or mesh[axis] % config.dcn[axis] == 0,
            f"config.dcn.{axis}={config.dcn[axis]} does not divide config.mesh.{axis}={mesh[axis]}: "
            f"the DCN factor is part of the axis (slices x devices per slice along it)",
        )
    product = math.prod(mesh[a] for a in MESH_AXES)
    if num_devices is not None:
        sizes = " x ".join(f"{a}={mesh[a]}" for a in MESH_AXES if mesh[a] > 1) or "all 1"
        _require(
            product == num_devices,
            f"config.mesh ({sizes}) has {product} devices but {num_devices} are available: "
            f"set config.mesh.* so that data*pipe*fsdp*expert*seq*tensor = {num_devices} (or one "
            "axis to -1)",
        )
    if fill_axis(config) is not None:  # device count unknown yet: check the rest with that axis at 1
        config = copy.deepcopy(config)
        config.mesh[fill_axis(config)] = 1
        m, mesh, t = config.model, config.mesh, config.train

    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
        _require(isinstance(m[key], int) and m[key] >= 1, f"config.model.{key} must be a positive integer")
    _require(
        m.n_heads % m.n_kv_heads == 0,
        f"config.model.n_heads={m.n_heads} must be a multiple of n_kv_heads={m.n_kv_heads}",
    )
    _require(m.head_dim % 2 == 0, f"config.model.head_dim={m.head_dim} must be even (rotary embeddings)")
    _check_rope(m)
    _check_gemma_pieces(m)
    _check_mla(m)
    _require(m.remat in REMAT_POLICIES, f"config.model.remat={m.remat!r}: choose one of {REMAT_POLICIES}")
    _require(
        m.attention_impl in ATTENTION_IMPLS,
        f"config.model.attention_impl={m.attention_impl!r}: choose one of {ATTENTION_IMPLS}",
    )
    _require(
        m.attention_kernel in ATTENTION_KERNELS,
        f"config.model.attention_kernel={m.attention_kernel!r}: choose one of {ATTENTION_KERNELS}",
    )
    _require(
        m.attention_kernel == "auto" or m.attention_impl == "pallas",
        f"config.model.attention_kernel={m.attention_kernel!r} picks a Pallas flash kernel: it needs "
        f"config.model.attention_impl='pallas' (it is {m.attention_impl!r}); or set attention_kernel='auto'",
    )
    pattern = layer_pattern(m)
    _require(
        bool(pattern) and all(p in LAYER_TYPES for p in pattern),
        f"config.model.layer_pattern={m.layer_pattern!r}: a comma-separated list of {LAYER_TYPES}",
    )
    _require(
        m.n_layers % len(pattern) == 0,
        f"config.model.n_layers={m.n_layers} is not a multiple of the {len(pattern)} layers of "
        f"config.model.layer_pattern={m.layer_pattern!r}",
    )
    window = m.get("sliding_window", 0)
    _require(
        isinstance(window, int) and not isinstance(window, bool) and window >= 0,
        f"config.model.sliding_window={window!r} must be an integer >= 0 (keys a local layer's query sees)",
    )
    _require(
        ("local" in pattern) == (window > 0),
        f"config.model.layer_pattern={m.layer_pattern!r} with config.model.sliding_window={window}: "
        + (
            "'local' layers need sliding_window > 0 (e.g. 4096 for Mistral v0.1)"
            if "local" in pattern
            else "a sliding window applies to 'local' layers only: put 'local' in layer_pattern (e.g. "
            "'local' for every layer) or set sliding_window=0"
        ),
    )
    mlps = mlp_pattern(m)
    _require(
        bool(mlps) and all(p in MLP_TYPES for p in mlps),
        f"config.model.mlp_pattern={m.mlp_pattern!r}: a comma-separated list of {MLP_TYPES}",
    )
    period = len(block_pattern(m))
    _require(
        m.n_layers % period == 0,
        f"config.model.n_layers={m.n_layers} is not a multiple of {period}, the period of "
        f"config.model.layer_pattern={m.layer_pattern!r} with config.model.mlp_pattern="
        f"{m.mlp_pattern!r}",
    )
    _require(m.residual in RESIDUALS, f"config.model.residual={m.residual!r}: choose one of {RESIDUALS}")
    _require(
        m.residual == "standard" or mesh.pipe == 1,
        f"config.model.residual={m.residual!r} with config.mesh.pipe={mesh.pipe}: the ladder residual "
        "carries the last module's output (not yet added) from layer to layer, and the pipeline "
        "stages pass only the residual stream on; flushing it at a stage boundary would make the "
        "architecture depend on the layout. Use config.mesh.pipe=1 or residual='standard'",
    )
    _validate_moe(config)
    _validate_optimizer(config)
    _validate_quant(config)
    _validate_flax(config)
    _validate_mtp(config)
    sv = config.serve
    for key in ("pages", "page_size", "token_budget", "chunk_size", "max_seqs"):
        _require(
            isinstance(sv[key], int) and sv[key] >= 1, f"config.serve.{key}={sv[key]!r} must be a positive integer"
        )
    _require(sv.policy in SERVE_POLICIES, f"config.serve.policy={sv.policy!r}: choose one of {SERVE_POLICIES}")
    _validate_speculation(sv)
    _require(sv.kv_quant in KV_QUANT, f"config.serve.kv_quant={sv.kv_quant!r}: choose one of {KV_QUANT}")
    _require(sv.cache in CACHE_KINDS, f"config.serve.cache={sv.cache!r}: choose one of {CACHE_KINDS}")
    _require(
        sv.allocation in ("on_demand", "reserve"),
        f"config.serve.allocation={sv.allocation!r}: choose one of ('on_demand', 'reserve')",
    )
    _require(
        isinstance(sv.decode_steps, int) and sv.decode_steps >= 1,
        f"config.serve.decode_steps={sv.decode_steps!r} must be an integer >= 1",
    )
    _require(
        sv.preemption in ("recompute", "swap"),
        f"config.serve.preemption={sv.preemption!r}: choose one of ('recompute', 'swap')",
    )
    for key in ("prefix_cache", "ragged", "overlap"):
        _require(isinstance(sv[key], bool), f"config.serve.{key}={sv[key]!r} must be true or false")
    _require(
        sv.cache == "paged" or sv.kv_quant == "none",
        f"config.serve.cache={sv.cache!r} with config.serve.kv_quant={sv.kv_quant!r}: the quantized cache is "
        "paged; set cache='paged' or kv_quant='none'",
    )
    _require(
        sv.kv_quant == "none" or not (config.model.mla.kv_lora_rank and config.model.mla.cache == "latent"),
        f"config.serve.kv_quant={sv.kv_quant!r} quantizes per-head keys and values; MLA's latent cache "
        "(config.model.mla.cache='latent') has none: set kv_quant='none', or config.model.mla.cache='expanded' "
        "to quantize the expanded heads",
    )
    _require(
        sv.cache == "paged" or sv.draft != "self",
        f"config.serve.cache={sv.cache!r} with config.serve.draft='self': self-speculation reads a window of "
        "the target's pages; set cache='paged' or use a draft model",
    )
    _require(
        isinstance(sv.kv_residual, int) and sv.kv_residual >= 0,
        f"config.serve.kv_residual={sv.kv_residual!r} must be an integer >= 0 (pages)",
    )
    _require(
        m.attention_block == 0 or (m.attention_block >= 16 and m.attention_block & (m.attention_block - 1) == 0),
        f"config.model.attention_block={m.attention_block}: the flash kernel's tile must be a power "
        "of two >= 16 (the TPU kernel rounds it up to a multiple of 128), or 0 for the tuning cache's "
        "tile for the shape on this device (else 128)",
    )
    _require(
        m.linear_chunk >= 8 and m.linear_chunk % 8 == 0,
        f"config.model.linear_chunk={m.linear_chunk} must be a positive multiple of 8",
    )
    for key in ("param_dtype", "compute_dtype"):
        _require(m[key] in DTYPES, f"config.model.{key}={m[key]!r}: choose one of {DTYPES}")

    # Rules: which mesh axes may hold which logical axes.
    # embed over `data` too: ZeRO-3 over every rank (`data` minor, so that hpZ's secondary is contiguous)
    param_allowed = {"embed": ("fsdp", "data"), "layers": ("pipe",), "experts": ("expert",)}
    for logical in ("vocab", "heads", "kv_heads", "mlp"):
        param_allowed[logical] = ("tensor",)
    param_allowed["head_dim"] = ()
    param_allowed["latent"] = ("fsdp", "data")  # MLA's latent rows of the up-projections, ZeRO-3 like embed
    for table, allowed_extra in (("params", {}), ("compute", {"batch": ("data", "fsdp", "expert"), "seq": ("seq",)})):
        rules = config.sharding[table]
        for logical, rule in rules.items():
            allowed = allowed_extra.get(logical, param_allowed.get(logical))
            _require(allowed is not None, f"config.sharding.{table}.{logical}: unknown logical axis")
            for axis in axes_of(rule):
                _require(
                    axis in allowed,
                    f"config.sharding.{table}.{logical}={rule!r}: mesh axis {axis!r} is not "
                    f"supported here; allowed: {allowed or 'none (leave it empty)'}",
                )
    for logical in ("vocab", "heads", "kv_heads", "mlp", "experts"):
        _require(
            config.sharding.compute[logical] == config.sharding.params[logical],
            f"config.sharding.compute.{logical} must equal config.sharding.params.{logical} "
            "(tensor- and expert-parallel weights are used where they live)",
        )
    _require(
        config.sharding.params.heads == config.sharding.params.kv_heads,
        "config.sharding.params.heads and .kv_heads must be equal (query heads are grouped "
        "with their key/value head on the same rank)",
    )
    for axis in ("data", "fsdp", "expert"):
        _require(
            mesh[axis] == 1 or axis in axes_of(config.sharding.compute.batch),
            f"config.mesh.{axis}={mesh[axis]} but {axis!r} is not in config.sharding.compute.batch "
            f"({config.sharding.compute.batch!r}): add it, or set config.mesh.{axis}=1",
        )
    for logical in ("embed", "latent"):
        _require(
            config.sharding.compute.get(logical, "") == "",
            f"config.sharding.compute.{logical} must be empty: weights are gathered over fsdp before use",
        )
    _require(
        config.sharding.compute.layers == config.sharding.params.layers,
        "config.sharding.compute.layers must equal config.sharding.params.layers (pipeline "
        "stages use the layers they hold)",
    )
    _require(
        mesh.pipe == 1 or config.sharding.params.layers == "pipe",
        f"config.mesh.pipe={mesh.pipe} but config.sharding.params.layers="
        f"{config.sharding.params.layers!r}: set it (and .compute.layers) to 'pipe'",
    )

    # Divisibility of the model by the mesh.
    sizes = {a: mesh[a] for a in MESH_AXES}
    # (logical axis, model key, size) of every dimension a rule may split; MoE keys only with MoE layers
    moe = "moe" in mlps
    dims = [
        ("vocab", "vocab_size", m.vocab_size),
        ("heads", "n_heads", m.n_heads),
        ("kv_heads", "n_kv_heads", m.n_kv_heads),
        ("embed", "d_model", m.d_model),
        ("head_dim", "head_dim", m.head_dim),
    ]
    dims += [("mlp", "d_ff", m.d_ff)] if "dense" in mlps else []
    if m.mla.kv_lora_rank:  # the latent rows of MLA's up-projections split like embed
        dims += [("latent", "mla.kv_lora_rank", m.mla.kv_lora_rank)]
        dims += [("latent", "mla.q_lora_rank", m.mla.q_lora_rank)] if m.mla.q_lora_rank else []
    dims += [("mlp", "moe.d_ff", m.moe.d_ff), ("experts", "moe.experts", m.moe.experts)] if moe else []
    if m.kind == "flax":  # the module's own shapes are checked by models/flax_model.check_layout
        dims = []
    for logical, key, size in dims:
        rule = config.sharding.params[logical]
        shards = math.prod(sizes[a] for a in axes_of(rule))
        if size % shards:
            raise ConfigError(
                f"config.model.{key}={size} is not divisible by the {shards} shards of mesh axis "
                f"{rule!r} (config.sharding.params.{logical}); change config.model.{key} or "
                f"config.mesh.{axes_of(rule)[0]}"
            )
    batch_shards = math.prod(sizes[a] for a in axes_of(config.sharding.compute.batch))
    _require(
        t.batch_size % batch_shards == 0,
        f"config.train.batch_size={t.batch_size} is not divisible by the {batch_shards} batch "
        f"shards (mesh axes {config.sharding.compute.batch}); change the batch size or the mesh",
    )
    _require(
        m.context_parallel in CONTEXT_PARALLEL,
        f"config.model.context_parallel={m.context_parallel!r}: choose one of {CONTEXT_PARALLEL}",
    )
    _require(
        mesh.seq == 1 or "seq" in axes_of(config.sharding.compute.seq),
        f"config.mesh.seq={mesh.seq} but config.sharding.compute.seq is empty: set it to 'seq'",
    )
    cp_chunks = mesh.seq * (2 if m.context_load_balance else 1) if mesh.seq > 1 else 1
    _require(
        config.data.seq_len % cp_chunks == 0,
        f"config.data.seq_len={config.data.seq_len} is not divisible into the {cp_chunks} chunks of "
        f"context parallelism (mesh.seq={mesh.seq}"
        f"{', x2 for context_load_balance' if m.context_load_balance else ''}): change seq_len or mesh.seq",
    )
    _require(
        mesh.seq == 1 or m.attention_impl != "cudnn",
        "config.model.attention_impl='cudnn' cannot run context parallelism (it returns no "
        "log-sum-exp to merge blocks with): use 'pallas' or 'reference' with mesh.seq > 1",
    )
    _require(
        mesh.seq == 1 or "local" not in layer_pattern(m),
        f"config.model.layer_pattern={m.layer_pattern!r} has sliding-window layers, which context "
        f"parallelism (mesh.seq={mesh.seq}) does not implement: use mesh.seq=1",
    )
    if config.parallel.sequence_parallel:
        _require(
            config.data.seq_len // mesh.seq % sizes["tensor"] == 0,
            f"config.data.seq_len={config.data.seq_len} / mesh.seq={mesh.seq} must be divisible by "
            f"config.mesh.tensor={sizes['tensor']} for sequence parallelism",
        )
        for logical in ("vocab", "heads", "kv_heads", "mlp"):
            _require(
                config.sharding.params[logical] == "tensor",
                "config.parallel.sequence_parallel needs heads, kv_heads, mlp and vocab on 'tensor'",
            )
    if config.parallel.collective_matmul:
        _require(
            sizes["tensor"] > 1 and config.parallel.sequence_parallel,
            f"config.parallel.collective_matmul=True needs tensor parallelism with sequence parallelism "
            f"(it decomposes SP's all-gather / reduce-scatter over T): got config.mesh.tensor="
            f"{sizes['tensor']}, config.parallel.sequence_parallel={config.parallel.sequence_parallel}; "
            f"set both, or collective_matmul=False",
        )
    _validate_pipeline(config)
    _require(
        isinstance(config.parallel.fsdp_prefetch, bool),
        f"config.parallel.fsdp_prefetch={config.parallel.fsdp_prefetch!r}: choose True or False",
    )
    _require(
        not (config.parallel.fsdp_prefetch and config.offload.params),
        "config.parallel.fsdp_prefetch cannot be combined with config.offload.params yet (the "
        "prefetch indexes the next layer out of the host-memory stack): turn one of them off",
    )
    _check_zeropp(config)
    _require(
        t.zero_stage in (0, 1, 2),
        f"config.train.zero_stage={t.zero_stage}: choose 0, 1 or 2 (stage 3 is config.mesh.fsdp)",
    )
    _require(t.schedule in SCHEDULES, f"config.train.schedule={t.schedule!r}: choose one of {SCHEDULES}")
    _require(t.steps >= 1, "config.train.steps must be >= 1")
    _require(t.log_every >= 1, "config.train.log_every must be >= 1")
    _require(0 <= config.data.eval_fraction < 0.5, "config.data.eval_fraction must be in [0, 0.5)")
    _validate_data(config)
    _validate_finetune(config)
    ck = config.checkpoint
    _require(
        ck.every_steps >= 0 and ck.every_minutes >= 0 and ck.keep >= 0 and ck.keep_period >= 0,
        "config.checkpoint.every_steps, .every_minutes, .keep and .keep_period must be >= 0",
    )
    sn = t.snapshot
    _require(
        sn.every >= 0,
        f"config.train.snapshot.every={sn.every}: use k >= 1 (a snapshot every k steps) or 0 (off)",
    )
    _require(sn.keep >= 1, f"config.train.snapshot.keep={sn.keep}: keep at least 1 complete snapshot")
    _require(
        sn.peer_timeout_s >= 0,
        f"config.train.snapshot.peer_timeout_s={sn.peer_timeout_s}: use seconds > 0, or 0 for no watchdog",
    )
    _validate_compile_cache(config)
    _validate_outer(config)


DATA_FORMATS = ("text", "chat", "preference")  # config.data.format (docs/data.md, docs/finetune.md)
DOCUMENT_SOURCES = ("jsonl", "parquet", "hf")  # corpora of documents, tokenized into shards (jaxsys/data/shards.py)


def _validate_data(config) -> None:
    d = config.data
    _require(
        d.format in DATA_FORMATS,
        f"config.data.format={d.format!r}: choose one of {DATA_FORMATS}",
    )
    _require(isinstance(d.packing, bool), f"config.data.packing={d.packing!r}: choose True or False")
    _require(
        isinstance(d.shard_docs, int) and d.shard_docs >= 1,
        f"config.data.shard_docs={d.shard_docs!r} must be a positive integer",
    )
    _require(
        isinstance(d.tokenize_workers, int) and d.tokenize_workers >= 0,
        f"config.data.tokenize_workers={d.tokenize_workers!r} must be an integer >= 0 (0: one per core)",
    )
    _require(
        isinstance(d.prefetch, int) and d.prefetch >= 0, f"config.data.prefetch={d.prefetch!r} must be an integer >= 0"
    )
    documents = d.source in DOCUMENT_SOURCES
    _require(
        documents or d.format == "text",
        f"config.data.format={d.format!r} needs a corpus of documents (config.data.source one of {DOCUMENT_SOURCES}), "
        f"not {d.source!r}",
    )
    _require(
        documents or not d.packing,
        f"config.data.packing=True packs documents: config.data.source={d.source!r} is one token stream without "
        f"document boundaries; use a source of documents ({', '.join(DOCUMENT_SOURCES)})",
    )
    _require(
        not (d.packing and d.format == "preference"),
        "config.data.packing=True with config.data.format='preference': a pair's two completions sit on rows "
        "2i and 2i + 1 of the batch, one a row; use packing=False",
    )
    _require(isinstance(d.adaptive_cp, bool), f"config.data.adaptive_cp={d.adaptive_cp!r}: choose True or False")
    if d.adaptive_cp:
        _require(
            documents and d.packing,
            "config.data.adaptive_cp=True lays out packed rows of documents: set config.data.packing=True with a "
            f"source of documents ({', '.join(DOCUMENT_SOURCES)}), or adaptive_cp=False",
        )
        _require(
            config.mesh.seq > 1,
            "config.data.adaptive_cp=True places documents on the devices of the seq axis, but config.mesh.seq=1: "
            "set mesh.seq > 1 (context parallelism) or adaptive_cp=False",
        )
    local = d.adaptive_cp_local
    _require(
        isinstance(local, (int, float)) and not isinstance(local, bool) and 0 <= local < 1,
        f"config.data.adaptive_cp_local={local!r}: the share of each seq device's tokens in its local region, "
        "a number in [0, 1) (0: the whole row on the ring)",
    )
    if local:
        _require(
            d.adaptive_cp,
            f"config.data.adaptive_cp_local={local} needs config.data.adaptive_cp=True (the host plan fills the "
            "local regions with whole documents); set it, or adaptive_cp_local=0",
        )
        from jaxsys.parallel import context

        try:
            context.region_sizes(int(d.seq_len), int(config.mesh.seq), bool(config.model.context_load_balance), local)
        except ValueError as e:
            _require(False, f"config.data.adaptive_cp_local={local} with config.data.seq_len={d.seq_len}: {e}")
    groups_text = d.get("adaptive_cp_groups", "")
    _require(
        isinstance(groups_text, str),
        f"config.data.adaptive_cp_groups={groups_text!r}: a string like '2:0.25,4:0.25' (g:share of each seq "
        "device's tokens in rings within groups of g), or '' for none",
    )
    if groups_text.strip():
        from jaxsys.parallel import context

        key = f"config.data.adaptive_cp_groups={groups_text!r}"
        try:
            groups = context.parse_groups(groups_text)
        except ValueError as e:
            groups = ()
            _require(False, f"{key}: {e}; write g:share items separated by commas, e.g. '2:0.25,4:0.25'")
        _require(
            d.adaptive_cp,
            f"{key} needs config.data.adaptive_cp=True (the host plan fills the group regions); set it, or "
            "adaptive_cp_groups=''",
        )
        _require(
            config.model.context_parallel == "ring",
            f"{key} with config.model.context_parallel={config.model.context_parallel!r}: rings within groups run "
            "only with context_parallel='ring'; set it, or adaptive_cp_groups=''",
        )
        seq = int(config.mesh.seq)
        for g, share in groups:
            _require(
                1 < g < seq and seq % g == 0,
                f"{key}: group size {g} must divide config.mesh.seq={seq} with 1 < g < {seq} (g=1 is "
                "adaptive_cp_local, g=mesh.seq the full ring)",
            )
            _require(0 < share < 1, f"{key}: share {share} of group size {g} must be in (0, 1)")
        _require(
            all(a < b for (a, _), (b, _) in zip(groups, groups[1:])),
            f"{key}: list the group sizes once each, smallest first (their regions follow that order in the row)",
        )
        _require(
            local + sum(s for _, s in groups) < 1,
            f"{key} with config.data.adaptive_cp_local={local}: the shares sum to {local + sum(s for _, s in groups)}; "
            "they must leave a positive remainder (< 1) for the full ring",
        )
        try:
            context.region_sizes(int(d.seq_len), seq, bool(config.model.context_load_balance), local, groups)
        except ValueError as e:
            _require(False, f"{key} with config.data.seq_len={d.seq_len} and adaptive_cp_local={local}: {e}")
    _validate_buckets(config)
    if d.packing:
        _require(
            "linear" not in layer_pattern(config.model),
            f"config.data.packing=True with config.model.layer_pattern={config.model.layer_pattern!r}: linear-attention "
            "layers keep one recurrent state per row and cannot reset it at a document boundary yet; use "
            "packing=False (padded rows) or softmax layers",
        )
        _require(
            config.model.kind == "jaxsys",
            "config.data.packing=True with config.model.kind='flax': a Flax module takes no segment ids; use "
            "packing=False (padded rows)",
        )


def adaptive_buckets(data_cfg) -> tuple[float, ...]:
    """config.data.adaptive_cp_buckets as local shares ("0,0.5" -> (0.0, 0.5)); () when unset."""
    spec = str(data_cfg.get("adaptive_cp_buckets", "") or "")
    return tuple(float(x) for x in spec.split(",") if x.strip())


def _validate_buckets(config) -> None:
    """config.data.adaptive_cp_buckets: local shares each of which suits the row, with
    adaptive_cp_local (the eval layout) among them."""
    d = config.data
    spec = d.get("adaptive_cp_buckets", "")
    _require(
        isinstance(spec, str), f"config.data.adaptive_cp_buckets={spec!r}: a comma list of local shares, e.g. '0,0.5'"
    )
    if not spec.strip():
        return
    try:
        shares = list(adaptive_buckets(d))
    except ValueError:
        shares = []
    _require(
        len(shares) >= 2 and len(set(shares)) == len(shares),
        f"config.data.adaptive_cp_buckets={spec!r}: two or more distinct local shares, comma separated "
        "(e.g. '0,0.5'), or '' for one layout",
    )
    _require(
        d.adaptive_cp,
        f"config.data.adaptive_cp_buckets={spec!r} needs config.data.adaptive_cp=True (the host plan lays each "
        "batch out for its bucket); set it, or adaptive_cp_buckets=''",
    )
    _require(
        float(d.adaptive_cp_local) in shares,
        f"config.data.adaptive_cp_buckets={spec!r} must include config.data.adaptive_cp_local="
        f"{d.adaptive_cp_local} (the eval split's layout, whose program evaluates)",
    )
    from jaxsys.parallel import context

    try:
        groups = context.parse_groups(str(d.get("adaptive_cp_groups", "")))
    except ValueError:
        groups = ()  # named by the adaptive_cp_groups check
    for f in shares:
        try:
            _require(0 <= f < 1, f"config.data.adaptive_cp_buckets={spec!r}: share {f} is not in [0, 1)")
            context.region_sizes(
                int(d.seq_len), int(config.mesh.seq), bool(config.model.context_load_balance), f, groups
            )
        except ValueError as e:
            _require(False, f"config.data.adaptive_cp_buckets={spec!r} with config.data.seq_len={d.seq_len}: {e}")


def lora_targets(config) -> tuple[str, ...]:
    """The projections `config.lora.targets` names ("wq,wv" -> ("wq", "wv"))."""
    return tuple(n.strip() for n in str(config.lora.targets).split(",") if n.strip())


def profile_range(config) -> tuple[int, int] | None:
    """`config.train.profile_steps` "a:b" -> (a, b), the 1-based steps to trace; None when empty."""
    text = str(config.train.profile_steps).strip()
    if not text:
        return None
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last if sep else first)
    except ValueError:
        raise ConfigError(
            f"config.train.profile_steps={text!r}: give the steps to trace as 'a:b' (1-based, inclusive), e.g. '5:7'"
        ) from None
    return a, b


def _validate_finetune(config) -> None:
    """config.lora (LoRA / QLoRA), config.train.objective (DPO) and config.train.profile_steps
    against the rest of the config (docs/finetune.md)."""
    lo, t, m, mesh = config.lora, config.train, config.model, config.mesh
    _require(
        isinstance(lo.rank, int) and lo.rank >= 0, f"config.lora.rank={lo.rank!r} must be an integer >= 0 (0: off)"
    )
    _require(isinstance(lo.alpha, (int, float)) and lo.alpha > 0, f"config.lora.alpha={lo.alpha!r} must be > 0")
    _require(
        isinstance(lo.dropout, (int, float)) and 0.0 <= lo.dropout < 1.0,
        f"config.lora.dropout={lo.dropout!r} must be in [0, 1)",
    )
    bad = [n for n in lora_targets(config) if n not in LORA_TARGETS]
    _require(not bad, f"config.lora.targets={lo.targets!r}: unknown projection(s) {bad}; choose from {LORA_TARGETS}")
    if lo.rank > 0:
        attention = {"wq", "wk", "wv", "wo"}
        if m.mla.kv_lora_rank:  # MLA: its latent projections, wo, and wq or the query latent's pair
            attention = {"wo", "wkv_a", "wk_rope", "wk_b", "wv_b"} | ({"wq_a", "wq_b"} if m.mla.q_lora_rank else {"wq"})
        present = attention | ({"w_gate", "w_up", "w_down"} if "dense" in mlp_pattern(m) else set())
        _require(
            bool(set(lora_targets(config)) & present),
            f"config.lora.targets={lo.targets!r} names no projection this model has (it has {sorted(present)}); "
            "MoE experts take no adapters",
        )
        refused = [
            ("config.model.kind", m.kind, "jaxsys", "the adapters wrap jaxsys's own projections"),
            ("config.mesh.pipe", mesh.pipe, 1, "the pipeline executor differentiates every weight of a stage"),
            ("config.train.optimizer", t.optimizer, "adamw", "the adapters are trained by AdamW"),
            ("config.model.quant_train", m.quant_train, "none", "the base is frozen (a quantized base is QLoRA)"),
            ("config.offload.optimizer", config.offload.optimizer, False, "the adapters' state is small"),
            ("config.offload.params", config.offload.params, False, "not implemented for adapters"),
            (
                "config.parallel.expert_rebalance_every",
                config.parallel.expert_rebalance_every,
                0,
                "experts take no adapters and re-placing them would move frozen weights",
            ),
            ("config.train.outer.method", t.outer.method, "none", "DiLoCo's islands average every weight"),
        ]
        for key, value, supported, why in refused:
            _require(
                value == supported,
                f"{key}={value!r} with config.lora.rank={lo.rank}: {why}; use {supported!r} (docs/finetune.md)",
            )
    _require(t.objective in OBJECTIVES, f"config.train.objective={t.objective!r}: choose one of {OBJECTIVES}")
    _require(
        isinstance(t.dpo.beta, (int, float)) and t.dpo.beta > 0, f"config.train.dpo.beta={t.dpo.beta!r} must be > 0"
    )
    preference = config.data.format == "preference"
    _require(
        preference == (t.objective == "dpo"),
        f"config.train.objective={t.objective!r} with config.data.format={config.data.format!r}: DPO trains on "
        "chosen/rejected pairs, so objective='dpo' and format='preference' go together (docs/finetune.md)",
    )
    if t.objective == "dpo":
        for key, value, supported, why in (
            ("config.mesh.pipe", mesh.pipe, 1, "a pair's log-probabilities are summed on one stage"),
            ("config.mesh.seq", mesh.seq, 1, "a sequence's log-probability would be split over devices"),
            ("config.train.optimizer", t.optimizer, "adamw", "DPO differentiates its loss"),
            ("config.model.kind", m.kind, "jaxsys", "the reference forward runs jaxsys's transformer"),
            ("config.train.outer.method", t.outer.method, "none", "DiLoCo's inner step is the LM objective's"),
        ):
            _require(value == supported, f"{key}={value!r} with config.train.objective='dpo': {why}; use {supported!r}")
        shards = math.prod(mesh[a] for a in axes_of(config.sharding.compute.batch) if mesh[a] > 0)
        per = 2 * shards * t.microbatches
        _require(
            t.batch_size % per == 0,
            f"config.train.batch_size={t.batch_size} with config.train.objective='dpo': each batch shard (and "
            f"micro-batch) holds whole chosen/rejected pairs, so the batch must be a multiple of 2 x {shards} "
            f"batch shards x {t.microbatches} micro-batches = {per}",
        )
    steps = profile_range(config)
    if steps is not None:
        a, b = steps
        _require(
            1 <= a <= b <= t.steps,
            f"config.train.profile_steps={t.profile_steps!r}: need 1 <= a <= b <= config.train.steps={t.steps}",
        )


def offloaded_activations(config) -> tuple[str, ...]:
    return tuple(n.strip() for n in config.offload.activations.split(",") if n.strip())


def _validate_optimizer(config) -> None:
    t, o = config.train, config.offload
    _require(t.optimizer in OPTIMIZERS, f"config.train.optimizer={t.optimizer!r}: choose one of {OPTIMIZERS}")
    g = t.galore
    _require(isinstance(g.rank, int) and g.rank >= 1, f"config.train.galore.rank={g.rank!r} must be a positive integer")
    _require(
        isinstance(g.update_every, int) and g.update_every >= 1,
        f"config.train.galore.update_every={g.update_every!r} must be a positive integer",
    )
    _require(
        isinstance(g.scale, (int, float)) and g.scale > 0,
        f"config.train.galore.scale={g.scale!r} must be a number > 0 (alpha; 1 leaves the update unscaled)",
    )
    _require(
        t.optimizer != "galore" or any(n.strip() for n in str(g.leaves).split(",")),
        "config.train.optimizer='galore' with config.train.galore.leaves empty: name the weights to "
        "project (e.g. 'wq,wk,wv,wo,w_gate,w_up,w_down'), or use optimizer='adamw'",
    )
    _require(
        t.optimizer == "adamw" or o.optimizer_update != "host" or not (o.optimizer or o.params),
        f"config.offload.optimizer_update='host' runs AdamW's update leaf by leaf on the host; "
        f"config.train.optimizer={t.optimizer!r} is not supported there: use optimizer_update='device'",
    )
    _require(
        t.optimizer != "galore" or not o.optimizer,
        "config.offload.optimizer=True with config.train.optimizer='galore': offloading chooses the "
        "optimizer state by its parameter-shaped moments, and GaLore's (rank-r moments and projections, "
        "docs/galore.md) is not parameter-shaped, so nothing would move: set offload.optimizer=False "
        "(GaLore already shrinks that state; offload.params works with it) or use optimizer='adamw'",
    )
    _require(
        t.optimizer != "galore" or config.parallel.expert_rebalance_every == 0,
        f"config.parallel.expert_rebalance_every={config.parallel.expert_rebalance_every} with "
        "config.train.optimizer='galore': re-placing experts permutes the parameter-shaped optimizer "
        "moments, and GaLore's live in the projected space: set expert_rebalance_every=0 or use "
        "optimizer='adamw'",
    )
    mu = t.muon
    _require(
        isinstance(mu.beta, (int, float)) and 0 <= mu.beta < 1,
        f"config.train.muon.beta={mu.beta!r} must be in [0, 1) (the momentum)",
    )
    _require(
        isinstance(mu.ns_steps, int) and mu.ns_steps >= 1,
        f"config.train.muon.ns_steps={mu.ns_steps!r} must be a positive integer (Newton-Schulz iterations; 5)",
    )
    _require(
        isinstance(mu.consistent_rms, (int, float)) and mu.consistent_rms >= 0,
        f"config.train.muon.consistent_rms={mu.consistent_rms!r} must be >= 0 (0.2: AdamW's update RMS; 0: "
        "width scaling)",
    )
    _require(
        t.optimizer != "muon" or not o.optimizer,
        "config.train.optimizer='muon' with config.offload.optimizer=True: offloading chooses the optimizer "
        "state by its parameter-shaped moments, and Muon's (one partition's leaves each, the others masked) "
        "are not, so nothing would move: set offload.optimizer=False (offload.params works) or use "
        "optimizer='adamw'",
    )
    _require(
        t.optimizer != "muon" or config.parallel.expert_rebalance_every == 0,
        f"config.parallel.expert_rebalance_every={config.parallel.expert_rebalance_every} with "
        "config.train.optimizer='muon': re-placing experts permutes AdamW-shaped state only; set "
        "expert_rebalance_every=0 or use optimizer='adamw'",
    )
    _require(t.zo.eps > 0, f"config.train.zo.eps={t.zo.eps!r} must be > 0")
    _require(
        t.optimizer != "zo" or config.mesh.pipe == 1,
        f"config.train.optimizer='zo' with config.mesh.pipe={config.mesh.pipe}: zeroth-order training "
        "runs forwards only and has no pipeline schedule; use mesh.pipe=1 (fsdp or offload.params "
        "hold a large model instead)",
    )
    _require(
        t.optimizer != "zo" or not o.optimizer,
        "config.offload.optimizer=True with config.train.optimizer='zo': zeroth-order training has no "
        "optimizer state to offload; use config.offload.params=True to keep the weights in host memory "
        "(ZO2, docs/zeroth_order.md)",
    )
    _require(
        o.optimizer_update in OPTIMIZER_UPDATE,
        f"config.offload.optimizer_update={o.optimizer_update!r}: choose one of {OPTIMIZER_UPDATE}",
    )
    _require(
        0.0 <= o.optimizer_fraction <= 1.0,
        f"config.offload.optimizer_fraction={o.optimizer_fraction!r} must be in [0, 1]",
    )
    bad = [n for n in offloaded_activations(config) if n not in ACTIVATION_NAMES]
    _require(
        not bad,
        f"config.offload.activations={o.activations!r}: unknown name(s) {bad}; the model names {ACTIVATION_NAMES}",
    )


def _validate_flax(config) -> None:
    """config.model.kind='flax' (models/flax_model.py): what jaxsys does for a Flax module. Its
    parameters are sharded by their logical names over data/fsdp (ZeRO, FSDP); the other mesh axes
    need the model to call jaxsys.parallel itself, and the options below reach into jaxsys's own
    transformer. Checked on the module itself when the program is built: its axis names and shapes."""
    m, mesh, t = config.model, config.mesh, config.train
    _require(m.kind in MODEL_KINDS, f"config.model.kind={m.kind!r}: choose one of {MODEL_KINDS}")
    if m.kind != "flax":
        _require(
            not m.flax_module,
            f"config.model.flax_module={m.flax_module!r} is set but config.model.kind="
            f"{m.kind!r}: set config.model.kind='flax' to train it",
        )
        return
    _require(
        m.flax_module.count(":") == 1 and all(m.flax_module.split(":")),
        f"config.model.flax_module={m.flax_module!r}: give 'package.module:ClassName' with config.model.kind='flax'",
    )
    for axis in ("tensor", "seq", "pipe", "expert"):
        _require(
            mesh[axis] == 1,
            f"config.mesh.{axis}={mesh[axis]} with config.model.kind='flax': a Flax model gets data "
            "parallelism, ZeRO and FSDP (config.mesh.data, config.mesh.fsdp) from its parameters' logical "
            f"names alone; {axis} parallelism needs per-shard model code that calls jaxsys.parallel "
            "(docs/flax.md). Set the axis to 1",
        )
    refused = [
        ("config.train.optimizer", t.optimizer, "adamw"),
        ("config.model.quant", m.quant, "none"),
        ("config.model.quant_train", m.quant_train, "none"),
        ("config.model.remat", m.remat, "none"),
        ("config.model.residual", m.residual, "standard"),
        ("config.model.qk_norm", m.qk_norm, False),
        ("config.model.qkv_bias", m.qkv_bias, False),
        ("config.model.rope_scaling", m.rope_scaling, "none"),
        ("config.model.layer_pattern", m.layer_pattern, "softmax"),
        ("config.model.embed_scale", m.embed_scale, False),
        ("config.model.mlp_activation", m.mlp_activation, "silu"),
        ("config.model.post_norms", m.post_norms, False),
        ("config.model.query_pre_attn_scalar", m.query_pre_attn_scalar, 0.0),
        ("config.model.attn_logit_softcap", m.attn_logit_softcap, 0.0),
        ("config.model.final_logit_softcap", m.final_logit_softcap, 0.0),
        ("config.offload.activations", config.offload.activations, ""),
        ("config.parallel.sequence_parallel", config.parallel.sequence_parallel, False),
        ("config.parallel.vocab_parallel", config.parallel.vocab_parallel, False),
        ("config.parallel.expert_rebalance_every", config.parallel.expert_rebalance_every, 0),
    ]
    for key, value, supported in refused:
        _require(
            value == supported,
            f"{key}={value!r} with config.model.kind='flax': it acts inside jaxsys's own transformer; "
            f"use {supported!r} (remat: nnx.remat in the module itself; docs/flax.md)",
        )


def _validate_mtp(config) -> None:
    """config.model.mtp (models/mtp.py) against the layouts and objectives it runs under."""
    m, mesh = config.model, config.mesh
    mt = m.mtp
    _require(
        isinstance(mt.depth, int) and not isinstance(mt.depth, bool) and mt.depth >= 0,
        f"config.model.mtp.depth={mt.depth!r} must be an integer >= 0 (0: no multi-token prediction)",
    )
    _require(
        isinstance(mt.loss_weight, (int, float)) and mt.loss_weight >= 0,
        f"config.model.mtp.loss_weight={mt.loss_weight!r} must be a number >= 0",
    )
    if not mt.depth:
        return
    refusals = [
        (
            mesh.pipe > 1,
            f"config.mesh.pipe={mesh.pipe}: the pipeline's last stage holds the main model's output, not "
            "the modules; use pipe=1",
        ),
        (
            mesh.seq > 1,
            f"config.mesh.seq={mesh.seq}: context parallelism splits the sequence, and module k reads "
            "token i + k of another shard; use seq=1",
        ),
        (m.kind != "jaxsys", f"config.model.kind={m.kind!r}: MTP is built for jaxsys's own transformer"),
        (
            config.train.optimizer == "zo",
            "config.train.optimizer='zo': the zeroth-order step perturbs the weights the main model reads; "
            "use a gradient optimizer",
        ),
        (
            config.train.objective != "lm",
            f"config.train.objective={config.train.objective!r}: the modules' loss is a next-token "
            "objective; use objective='lm' or mtp.depth=0",
        ),
        (config.train.outer.method != "none", "config.train.outer (DiLoCo): not combined with MTP yet"),
    ]
    for bad, why in refusals:
        _require(not bad, f"config.model.mtp.depth={mt.depth} with {why}")


def _validate_quant(config) -> None:
    """config.model.quant* against each other and the model's shapes on the mesh (w4a16's groups
    must not straddle the K' a tensor-parallel rank holds)."""
    m = config.model
    _require(m.quant in QUANT_FORMATS, f"config.model.quant={m.quant!r}: choose one of {QUANT_FORMATS}")
    _require(m.quant_train in QUANT_TRAIN, f"config.model.quant_train={m.quant_train!r}: choose one of {QUANT_TRAIN}")
    _require(m.quant_impl in QUANT_IMPLS, f"config.model.quant_impl={m.quant_impl!r}: choose one of {QUANT_IMPLS}")
    _require(
        m.quant == "none" or m.quant_train == "none",
        f"config.model.quant={m.quant!r} (a quantized checkpoint, for inference) and quant_train="
        f"{m.quant_train!r} ({m.quant_train} training of float weights) exclude each other: set one to 'none'",
    )
    _require(
        m.quant_train != "fp8" or config.train.outer.method == "none",
        f"config.model.quant_train='fp8' with config.train.outer.method={config.train.outer.method!r}: fp8's "
        "per-tensor scales take each tensor's amax over every data-parallel shard, an all-reduce per matmul "
        "across the islands that DiLoCo keeps apart; use quant_train='int8' (per-row scales, no "
        "communication) or outer.method='none'",
    )
    _require(isinstance(m.quant_rotate, bool), "config.model.quant_rotate must be true or false")
    four_bit = m.quant in ("w4a16", "w4a8", "w4a4")
    _require(
        four_bit or not m.quant_zero_point,
        f"config.model.quant_zero_point=True with quant={m.quant!r}: zero points are for the 4-bit formats "
        "(w4a16, w4a8, w4a4); set quant_zero_point=False",
    )
    _require(
        m.quant != "none" or not m.quant_rotate,
        "config.model.quant_rotate=True with quant='none': the rotation is of a quantized checkpoint's "
        "weights (python -m jaxsys.quantize --rotate writes one)",
    )
    if not four_bit and not m.quant_rotate:
        return
    G = m.quant_group_size
    named = f"config.model.quant={m.quant!r}" + (" with quant_rotate" if m.quant_rotate else "")
    _require(G in QUANT_GROUP_SIZES, f"config.model.quant_group_size={G!r}: choose one of {QUANT_GROUP_SIZES}")
    shards = lambda logical: math.prod(config.mesh[a] for a in axes_of(config.sharding.params[logical]))
    # (weight, contracted size K' on one rank)
    C, Q = m.mla.kv_lora_rank, m.mla.q_lora_rank
    hv = (m.mla.v_head_dim or m.head_dim) if C else m.head_dim
    local_k = [
        ("wq, wk, wv, w_gate, w_up (MLA: wq_a, wkv_a, wk_rope)", "d_model", m.d_model),
        ("wo", "n_heads * v_head_dim / tensor", m.n_heads * hv // shards("heads")),
    ]
    if C:  # MLA's up-projections contract the latents (never split over tensor)
        local_k.append(("wk_b, wv_b", "mla.kv_lora_rank", C))
    if C and Q:
        local_k.append(("wq_b", "mla.q_lora_rank", Q))
    if "dense" in mlp_pattern(m):
        local_k.append(("w_down", "d_ff / tensor", m.d_ff // shards("mlp")))
    for weights, what, k in local_k:
        _require(
            k % G == 0,
            f"{named} and quant_group_size={G}: the contracted size K' of {weights} "
            f"is {what} = {k} per rank, not a multiple of the group size; choose a group size that "
            f"divides {k} (of {QUANT_GROUP_SIZES}) or fewer tensor shards",
        )


def _validate_moe(config) -> None:
    """The MoE keys (checked only when mlp_pattern has MoE layers) and the expert-parallel ones."""
    m, moe, par = config.model, config.model.moe, config.parallel
    _require(
        par.expert_dispatch in EXPERT_DISPATCH,
        f"config.parallel.expert_dispatch={par.expert_dispatch!r}: choose one of {EXPERT_DISPATCH}",
    )
    _require(
        isinstance(par.expert_rebalance_every, int) and par.expert_rebalance_every >= 0,
        "config.parallel.expert_rebalance_every must be an integer >= 0 (0: never)",
    )
    if "moe" not in mlp_pattern(m):
        _require(
            par.expert_rebalance_every == 0,
            "config.parallel.expert_rebalance_every needs MoE layers: set config.model.mlp_pattern "
            "(e.g. 'moe' or 'dense,moe')",
        )
        return
    ep = math.prod(config.mesh[a] for a in axes_of(config.sharding.params.experts))
    _require(
        par.expert_rebalance_every == 0 or ep > 1,
        "config.parallel.expert_rebalance_every re-places experts on the devices that hold them, but "
        "the experts are not split (config.mesh.expert=1 or config.sharding.params.experts=''): set "
        "config.mesh.expert > 1 or expert_rebalance_every=0",
    )
    for key in ("experts", "top_k", "d_ff"):
        _require(
            isinstance(moe[key], int) and moe[key] >= 1,
            f"config.model.moe.{key} must be a positive integer, got {moe[key]!r}",
        )
    _require(
        moe.top_k <= moe.experts,
        f"config.model.moe.top_k={moe.top_k} is larger than config.model.moe.experts={moe.experts}: "
        "a token cannot pick more distinct experts than there are; lower top_k or add experts",
    )
    _require(
        isinstance(moe.shared_experts, int) and moe.shared_experts >= 0,
        "config.model.moe.shared_experts must be an integer >= 0",
    )
    _require(
        not moe.shared_expert_gate or moe.shared_experts > 0,
        "config.model.moe.shared_expert_gate=True gates the shared experts' output, but "
        "config.model.moe.shared_experts=0: set shared_experts >= 1 or the gate off",
    )
    _require(moe.router in MOE_ROUTERS, f"config.model.moe.router={moe.router!r}: choose one of {MOE_ROUTERS}")
    _require(
        moe.router == "sigmoid" or moe.top_k > 1 or not moe.renormalize,
        "config.model.moe.renormalize with a softmax router and top_k=1 makes every gate 1, so "
        "the router gets no gradient from the loss: set renormalize=false (as Switch does)",
    )
    for key in ("capacity_factor", "aux_loss_weight", "z_loss_weight", "bias_update_rate"):
        _require(float(moe[key]) >= 0, f"config.model.moe.{key} must be >= 0, got {moe[key]!r}")
    _check_group_routing(moe)
    _require(
        not moe.bias_update_rate or (config.mesh.pipe == 1 and config.train.optimizer not in ("zo",)),
        f"config.model.moe.bias_update_rate={moe.bias_update_rate} (auxiliary-loss-free balancing) updates "
        "every MoE layer's bias from the step's loads on each device; it is not implemented with a pipeline "
        "(config.mesh.pipe > 1) or zeroth-order training: set the rate to 0 or use pipe=1 and a gradient optimizer",
    )


def _check_group_routing(moe) -> None:
    """config.model.moe.routed_scale / groups / group_top_k / group_score / score_bias."""
    _require(float(moe.routed_scale) > 0, f"config.model.moe.routed_scale={moe.routed_scale!r} must be > 0")
    for key in ("groups", "group_top_k"):
        _require(
            isinstance(moe[key], int) and not isinstance(moe[key], bool) and moe[key] >= 1,
            f"config.model.moe.{key}={moe[key]!r} must be a positive integer (1: no group limit)",
        )
    _require(
        moe.group_score in MOE_GROUP_SCORES,
        f"config.model.moe.group_score={moe.group_score!r}: choose one of {MOE_GROUP_SCORES}",
    )
    _require(
        not moe.bias_update_rate or moe.score_bias,
        f"config.model.moe.bias_update_rate={moe.bias_update_rate} moves the choice bias, but "
        "config.model.moe.score_bias=False: set score_bias=True or the rate to 0",
    )
    if moe.groups == 1:
        return
    _require(
        moe.experts % moe.groups == 0,
        f"config.model.moe.groups={moe.groups} does not divide config.model.moe.experts={moe.experts} "
        "into equal groups: pick a divisor (8 of 256 in DeepSeek-V3)",
    )
    per_group = moe.experts // moe.groups
    _require(
        moe.group_top_k <= moe.groups and moe.top_k <= moe.group_top_k * per_group,
        f"config.model.moe.group_top_k={moe.group_top_k} of {moe.groups} groups of {per_group} experts "
        f"leaves fewer than top_k={moe.top_k} experts to choose from: raise group_top_k or lower top_k",
    )
    _require(
        moe.group_score != "top2" or per_group >= 2,
        f"config.model.moe.group_score='top2' sums each group's best two experts, but a group has "
        f"{per_group}: use group_score='max' or fewer groups",
    )


def _validate_pipeline(config) -> None:
    """Micro-batches, schedule, virtual stages and vocabulary parallelism against the mesh."""
    m, t, p = config.model, config.train, config.mesh.pipe
    mb, v = t.microbatches, t.virtual_stages
    _require(isinstance(mb, int) and mb >= 1, f"config.train.microbatches must be >= 1, got {mb!r}")
    _require(isinstance(v, int) and v >= 1, f"config.train.virtual_stages must be >= 1, got {v!r}")
    _require(
        t.pipeline_schedule in PIPELINE_SCHEDULES,
        f"config.train.pipeline_schedule={t.pipeline_schedule!r}: choose one of {PIPELINE_SCHEDULES}",
    )
    _require(
        isinstance(config.parallel.pipeline_overlap, bool),
        f"config.parallel.pipeline_overlap={config.parallel.pipeline_overlap!r}: choose True or False",
    )
    batch_shards = math.prod(config.mesh[a] for a in axes_of(config.sharding.compute.batch))
    _require(
        t.batch_size % (batch_shards * mb) == 0,
        f"config.train.batch_size={t.batch_size} does not split into {batch_shards} batch shards x "
        f"{mb} micro-batches (config.train.microbatches): make the batch size a multiple of "
        f"{batch_shards * mb}",
    )
    if p == 1:
        _require(
            v == 1, f"config.train.virtual_stages={v} needs a pipeline: set config.mesh.pipe > 1 or virtual_stages=1"
        )
        _require(
            not config.parallel.pipeline_overlap,
            "config.parallel.pipeline_overlap=True needs a pipeline (it overlaps the sends between "
            "pipeline stages): set config.mesh.pipe > 1 or pipeline_overlap=False",
        )
        return
    stages = p * v
    _require(
        m.n_layers % stages == 0,
        f"config.model.n_layers={m.n_layers} does not split into {stages} pipeline stages "
        f"(config.mesh.pipe={p} x config.train.virtual_stages={v}): choose n_layers a multiple "
        f"of {stages}",
    )
    period = len(block_pattern(m))
    _require(
        (m.n_layers // stages) % period == 0,
        f"each of the {stages} pipeline stages would hold {m.n_layers // stages} layers, not a "
        f"whole number of periods of config.model.layer_pattern={m.layer_pattern!r} and "
        f"mlp_pattern={m.mlp_pattern!r} ({period} layers): change n_layers, mesh.pipe or "
        "virtual_stages",
    )
    _require(
        mb >= p,
        f"config.train.microbatches={mb} is fewer than the {p} pipeline stages "
        f"(config.mesh.pipe): every stage would idle most of the step; use microbatches >= {p}",
    )
    if t.pipeline_schedule == "interleaved_1f1b":
        _require(
            mb % p == 0,
            f"the interleaved schedule takes micro-batches in groups of config.mesh.pipe={p}: "
            f"config.train.microbatches={mb} must be a multiple of {p}",
        )
    else:
        _require(
            v == 1,
            f"config.train.virtual_stages={v} needs config.train.pipeline_schedule="
            f"'interleaved_1f1b' (got {t.pipeline_schedule!r})",
        )
    if config.parallel.vocab_parallel:
        shards = p * math.prod(config.mesh[a] for a in axes_of(config.sharding.params.vocab))
        _require(
            m.vocab_size % shards == 0,
            f"config.model.vocab_size={m.vocab_size} does not split over the {shards} shards of "
            f"vocabulary parallelism (pipe x config.sharding.params.vocab): pad the vocabulary to "
            f"a multiple of {shards}",
        )


def _validate_compile_cache(config) -> None:
    """config.compile_cache (jaxsys/compile_cache.py)."""
    cc = config.compile_cache
    _require(
        isinstance(cc.dir, str),
        f"config.compile_cache.dir={cc.dir!r}: 'auto', a folder, or '' to turn the compile cache off",
    )
    _require(
        isinstance(cc.min_compile_secs, (int, float)) and cc.min_compile_secs >= 0,
        f"config.compile_cache.min_compile_secs={cc.min_compile_secs!r} must be a number >= 0 (0 writes every program)",
    )


OUTER_METHODS = ("none", "diloco", "co2")  # config.train.outer.method
OUTER_QUANTIZE = ("none", "int8", "int4")


def _validate_outer(config) -> None:
    """config.train.outer (DiLoCo, Streaming DiLoCo, CO2: jaxsys/optim/outer.py)."""
    t, o, mesh = config.train, config.train.outer, config.mesh
    _require(o.method in OUTER_METHODS, f"config.train.outer.method={o.method!r}: choose one of {OUTER_METHODS}")
    _require(
        o.quantize in OUTER_QUANTIZE, f"config.train.outer.quantize={o.quantize!r}: choose one of {OUTER_QUANTIZE}"
    )
    _require(
        isinstance(o.every, int) and o.every >= 1, f"config.train.outer.every={o.every!r} must be an integer >= 1 (H)"
    )
    _require(
        isinstance(o.fragments, int) and o.fragments >= 1,
        f"config.train.outer.fragments={o.fragments!r} must be an integer >= 1 (1: all parameters sync together)",
    )
    _require(o.lr > 0, f"config.train.outer.lr={o.lr!r} must be > 0 (1 with momentum 0: the islands' mean)")
    _require(0 <= o.momentum < 1, f"config.train.outer.momentum={o.momentum!r} must be in [0, 1)")
    for key in ("error_feedback", "co2_penalty"):
        _require(isinstance(o[key], bool), f"config.train.outer.{key}={o[key]!r}: choose True or False")
    _require(
        isinstance(o.overlap_steps, int) and 0 <= o.overlap_steps < o.every,
        f"config.train.outer.overlap_steps={o.overlap_steps!r} must be an integer in [0, every={o.every}) (tau: a "
        "fragment's sync lands before its next one starts)",
    )
    _require(0 <= o.merge < 1, f"config.train.outer.merge={o.merge!r} must be in [0, 1) (alpha: the islands' share)")
    _require(
        o.momentum_clip >= 0, f"config.train.outer.momentum_clip={o.momentum_clip!r} must be >= 0 (0: no clipping)"
    )
    _require(
        not o.error_feedback or o.quantize != "none",
        "config.train.outer.error_feedback=True keeps the quantization residual: set config.train.outer.quantize "
        "to 'int8' or 'int4'",
    )
    _require(
        not o.co2_penalty or o.method == "co2",
        f"config.train.outer.co2_penalty=True damps CO2's stale update: set config.train.outer.method='co2' "
        f"(now {o.method!r})",
    )
    _require(
        o.overlap_steps == 0 or o.method == "diloco",
        f"config.train.outer.overlap_steps={o.overlap_steps} is Streaming DiLoCo's overlap: with method="
        f"{o.method!r} use overlap_steps=0 (CO2 overlaps a whole round)",
    )
    if o.method == "none":
        return
    what = f"config.train.outer.method={o.method!r}"
    _require(
        t.optimizer in ("adamw", "sgd"),
        f"{what} with config.train.optimizer={t.optimizer!r}: the inner optimizer must be 'adamw' or 'sgd'",
    )
    _require(
        t.zero_stage == 0,
        f"{what} with config.train.zero_stage={t.zero_stage}: ZeRO shards the optimizer over `data`, whose "
        "ranks are islands with their own states here; set zero_stage=0 (shard inside islands with mesh.fsdp)",
    )
    _require(
        not (config.offload.optimizer or config.offload.params),
        f"{what} with config.offload.optimizer/params: not supported; turn offloading off",
    )
    _require(
        config.parallel.expert_rebalance_every == 0,
        f"{what} with config.parallel.expert_rebalance_every={config.parallel.expert_rebalance_every}: islands "
        "would re-place experts apart; set it to 0",
    )
    if o.fragments > 1:
        _require(
            mesh.pipe == 1,
            f"config.train.outer.fragments={o.fragments} with config.mesh.pipe={mesh.pipe}: fragments are layers "
            "p, p+P, ... of the layer stack, which a pipeline splits; use fragments=1 or pipe=1",
        )
        _require(
            o.fragments <= config.model.n_layers,
            f"config.train.outer.fragments={o.fragments} exceeds config.model.n_layers={config.model.n_layers}: "
            "a fragment is a set of layers",
        )
        _require(
            o.every % o.fragments == 0,
            f"config.train.outer.every={o.every} is not a multiple of config.train.outer.fragments={o.fragments}: "
            "the fragments sync every/fragments steps apart; make every a multiple of fragments",
        )


def _check_zeropp(config) -> None:
    """ZeRO-3 over `data` (sharding.params.embed with `data`) and ZeRO++ (config.parallel.zeropp_*)."""
    p, mesh = config.parallel, config.mesh
    embed = axes_of(config.sharding.params.embed)
    for key in ("zeropp_hpz", "zeropp_qwz", "zeropp_qgz"):
        _require(isinstance(p.get(key, False), bool), f"config.parallel.{key}={p.get(key)!r}: choose True or False")
    bits = p.get("zeropp_qgz_bits", 8)
    _require(bits in (8, 4), f"config.parallel.zeropp_qgz_bits={bits!r}: choose 8 or 4")
    _require(
        bits == 8 or p.get("zeropp_qgz", False),
        f"config.parallel.zeropp_qgz_bits={bits} sets qgZ's codes: set config.parallel.zeropp_qgz=True",
    )
    if "data" in embed:
        _require(
            embed in (("fsdp", "data"), ("data",)),
            f"config.sharding.params.embed={config.sharding.params.embed!r}: with `data` write 'fsdp,data' "
            "(`data` minor: each rank's block lies inside its fsdp block)",
        )
        _require(
            config.train.zero_stage == 0,
            f"config.train.zero_stage={config.train.zero_stage} with `data` in config.sharding.params.embed: "
            "the parameters are already sharded over data (ZeRO-3); set zero_stage=0",
        )
        _require(
            config.train.outer.method == "none",
            f"config.train.outer.method={config.train.outer.method!r} keeps an island per `data` rank, but "
            "config.sharding.params.embed shards the parameters over data: set it to 'fsdp'",
        )
    hpz = bool(p.get("zeropp_hpz", False))
    for key in ("zeropp_qwz", "zeropp_qgz"):
        _require(
            hpz or not p.get(key, False),
            f"config.parallel.{key}=True quantizes hpZ's `data` collectives: set config.parallel.zeropp_hpz=True",
        )
    if not hpz:
        return
    _require(
        embed == ("fsdp", "data") and mesh.data > 1 and mesh.fsdp > 1,
        f"config.parallel.zeropp_hpz needs ZeRO-3 over fsdp and data: set config.sharding.params.embed='fsdp,data' "
        f"(now {config.sharding.params.embed!r}) and config.mesh.data > 1, config.mesh.fsdp > 1 "
        f"(now {mesh.data}, {mesh.fsdp})",
    )
    _require(
        mesh.pipe == 1
        and not config.offload.params
        and config.model.kind != "flax"
        and config.model.quant == "none"
        and int(config.lora.rank) == 0,
        "config.parallel.zeropp_hpz is for the transformer's non-pipelined full training step with weights in "
        "device memory: set mesh.pipe=1, offload.params=False, model.quant='none', lora.rank=0 and a transformer model",
    )
