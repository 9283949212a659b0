"""A DeepSeek-V2-Lite-shaped model (15.7B parameters, 2.4B active: D=2048, L=27, multi-head latent
attention with N=16 heads of 128 + 64 rotary dims, values of 128, a key/value latent of 512 and
queries projected from x; the first layer a dense SwiGLU of 10944, then DeepSeekMoE: 64 routed
experts of 1408, top 6 by softmax, plus 2 shared experts; V=102400; YaRN x40 over a 4096 context),
bf16 compute, the flash kernel (its 192-dim heads run padded to 256), FSDP over the devices
besides expert parallelism.

    python -m jaxsys.train --config configs/deepseek_v2_lite.py --workdir runs/dsv2_lite
    python -m jaxsys.train --config configs/deepseek_v2_lite.py:cpu --workdir runs/dsv2_lite_cpu
    python -m jaxsys.analyze --config configs/deepseek_v2_lite.py --target v5p-32 --config.mesh.fsdp=16 --no-cpu --no-flops

(2026-12-07: on a v5p-8 at fsdp 4 the TPU compiler compiles the step and reports 160.8 GiB needed of
95.7; the formulas give 59.9 GiB per chip at fsdp 16, which the compiler has not yet confirmed.)

To fine-tune the released weights, convert them (`python -m jaxsys.convert --from-hf DIR --workdir W
--config configs/deepseek_v2_lite.py`, docs/checkpoints.md): the conversion sets the same model
from their config.json and keeps this config's training, data and mesh settings.

`:cpu` keeps every piece (the latent attention with a query latent as DeepSeek-V3's, a dense first
layer then routed and shared experts, V3's group-limited sigmoid routing with the
auxiliary-loss-free bias, YaRN) at D=128, L=4 and the byte vocabulary: about a minute on a laptop CPU.
"""

from jaxsys.config import base_config


def get_config(arg=None):
    c = base_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers = 102400, 2048, 27
    m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = 16, 16, 192, 10944
    m.mla.kv_lora_rank, m.mla.q_lora_rank, m.mla.rope_head_dim, m.mla.v_head_dim = 512, 0, 64, 128
    m.rope_theta, m.norm_eps = 10000.0, 1e-6
    m.rope_scaling, m.rope_factor, m.rope_original_max_position = "yarn", 40.0, 4096
    m.rope_attention_factor = 1.0  # mscale / mscale_all_dim = 0.707 / 0.707: the rotary magnitude stays 1
    # transformers' DeepSeek softmax factor mscale(0.707)^2 as H / mscale^4 (docs/mla.md)
    m.query_pre_attn_scalar = 192 / (0.1 * 0.707 * 3.6888794541139363 + 1) ** 4
    m.mlp_pattern = ",".join(["dense"] + ["moe"] * 26)
    moe = m.moe
    moe.experts, moe.top_k, moe.d_ff, moe.shared_experts = 64, 6, 1408, 2
    moe.router, moe.renormalize, moe.aux_loss_weight, moe.z_loss_weight = "softmax", False, 0.001, 0.0
    m.compute_dtype, m.remat, m.attention_impl = "bfloat16", "dots", "pallas"
    c.data.seq_len = 4096
    c.train.batch_size = 64
    c.train.steps = 10000
    c.train.lr, c.train.warmup_steps, c.train.schedule = 4.2e-4, 500, "wsd"
    c.train.log_every, c.train.eval_every = 50, 1000
    c.mesh.fsdp = -1  # all devices
    if arg == "cpu":
        m.vocab_size, m.d_model, m.n_layers = 256, 128, 4
        m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = 4, 4, 32, 384
        m.mla.kv_lora_rank, m.mla.q_lora_rank, m.mla.rope_head_dim, m.mla.v_head_dim = 64, 96, 16, 16
        m.rope_factor, m.rope_original_max_position = 4.0, 64
        m.query_pre_attn_scalar = 32 / (0.1 * 1.0 * 1.3862943611198906 + 1) ** 4  # V3's mscale_all_dim 1 at x4
        m.mlp_pattern = "dense,moe,moe,moe"
        moe.experts, moe.top_k, moe.d_ff, moe.shared_experts = 8, 2, 64, 1
        moe.router, moe.renormalize, moe.score_bias, moe.bias_update_rate = "sigmoid", True, True, 0.001
        moe.groups, moe.group_top_k, moe.group_score, moe.routed_scale = 4, 2, "top2", 2.5
        m.compute_dtype, m.remat, m.attention_impl = "float32", "none", "reference"
        c.data.seq_len, c.train.batch_size, c.train.steps = 128, 8, 50
        c.train.lr, c.train.warmup_steps, c.train.log_every, c.train.eval_every = 2e-3, 5, 10, 0
        c.mesh.fsdp = 1
    elif arg is not None:
        raise ValueError(f"configs/deepseek_v2_lite.py: unknown argument {arg!r}; use cpu")
    return c
