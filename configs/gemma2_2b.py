"""A Gemma-2-2B-shaped model (2.61B parameters: D=2304, L=26 alternating local (W=4096) and global
layers, N=8, K=4, H=256, F=9216 GeGLU, V=256000, tied embeddings scaled by sqrt(D), sandwich
norms, softmax scale 256^-0.5, attention scores soft-capped at 50 and logits at 30), bf16
compute, the flash kernel (cuDNN has no soft-cap), FSDP over all devices.

    python -m jaxsys.train --config configs/gemma2_2b.py --workdir runs/gemma2_2b
    python -m jaxsys.train --config configs/gemma2_2b.py:cpu --workdir runs/gemma2_2b_cpu
    python -m jaxsys.analyze --config configs/gemma2_2b.py --target v5p-8 --config.mesh.fsdp=4 --no-cpu --no-flops

To fine-tune the released weights instead, convert them (`python -m jaxsys.convert --from-hf DIR
--workdir W --config configs/gemma2_2b.py`, docs/checkpoints.md): the conversion sets the same
model from their config.json, and keeps this config's training, data and mesh settings.

Data: `config.data.source=tokens` with a pre-tokenized file in Gemma's vocabulary; without one it
falls back to the byte corpus (256 of the 256000 rows).

`:cpu` keeps the pieces (local/global alternation with a window shorter than the sequence, the
caps, GeGLU, post norms, tied scaled embeddings) at D=128, L=4 and the byte vocabulary, so it runs
on a laptop CPU in about a minute.
"""

from jaxsys.config import base_config


def get_config(arg=None):
    c = base_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers = 256000, 2304, 26
    m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = 8, 4, 256, 9216
    m.layer_pattern, m.sliding_window = "local,softmax", 4096
    m.rope_theta, m.tie_embeddings, m.norm_eps = 10000.0, True, 1e-6
    m.embed_scale, m.post_norms, m.mlp_activation = True, True, "gelu_tanh"
    m.query_pre_attn_scalar, m.attn_logit_softcap, m.final_logit_softcap = 256.0, 50.0, 30.0
    m.compute_dtype, m.remat, m.attention_impl = "bfloat16", "dots", "pallas"
    c.data.seq_len = 8192
    c.train.batch_size = 32
    c.train.steps = 10000
    c.train.lr, c.train.warmup_steps, c.train.schedule = 3e-4, 500, "wsd"
    c.train.log_every, c.train.eval_every = 50, 1000
    c.mesh.fsdp = -1  # all devices
    if arg == "cpu":
        m.vocab_size, m.d_model, m.n_layers = 256, 128, 4
        m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = 4, 2, 32, 512
        m.sliding_window, m.query_pre_attn_scalar = 32, 32.0
        m.compute_dtype, m.remat = "float32", "none"
        c.data.seq_len, c.train.batch_size, c.train.steps = 128, 8, 50
        c.train.lr, c.train.warmup_steps, c.train.log_every, c.train.eval_every = 2e-3, 5, 10, 0
        c.mesh.fsdp = 1
    elif arg is not None:
        raise ValueError(f"configs/gemma2_2b.py: unknown argument {arg!r}; use cpu")
    return c
