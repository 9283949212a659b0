"""Full fine-tuning vs LoRA (ranks 4, 16, 64) vs QLoRA (rank 16 over a w4a16 base) of configs/tiny.py
on a generated chat task (experiments/sft_lora/README.md).

    python experiments/sft_lora/run.py [--quick]

1. `generate.py` writes 2,000 chats (an instruction applied to a few words: shout, whisper, repeat,
   first) and a byte-identity Hugging Face tokenizer with a chat template.
2. The base: configs/tiny.py pretrained on the stdlib corpus (PRETRAIN steps, bytes).
3. Each variant fine-tunes it from config.checkpoint.init_from on the chats (format chat: the loss
   on the assistant's tokens; packed rows of 129 tokens; the last 10% of the chats held out) for
   FINETUNE steps of 8 rows; QLoRA's base is the pretrained one quantized w4a16 (round to nearest,
   groups of 64) by `python -m jaxsys.quantize`.
4. Reported per variant: the held-out loss on the assistant tokens before (step 0: the base) and
   after, the trainable parameters' bytes, the optimizer state's bytes (AdamW: two fp32 moments a
   trained parameter), the median seconds per step (from the logged tokens/s, step 1 left out), and
   what the chat looks like: greedy answers to three held-out prompts from the merged model.
"""

from __future__ import annotations

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import numpy as np  # noqa: E402

from experiments.common import save_results  # noqa: E402

WORK = "/tmp/jaxsys_sft_lora"
PRETRAIN, FINETUNE = 200, 100
VARIANTS = {  # name: (lora rank, quantized base, learning rate)
    "full": (0, False, 1e-3),
    "lora_r4": (4, False, 5e-3),
    "lora_r16": (16, False, 5e-3),
    "lora_r64": (64, False, 5e-3),
    "qlora_r16_w4a16": (16, True, 5e-3),
}


def finetune_overrides(work: str, steps: int) -> list[str]:
    return [
        "--config.data.source=jsonl",
        f"--config.data.path={work}/data/chats.jsonl",
        "--config.data.format=chat",
        f"--config.data.tokenizer={work}/data/tokenizer",
        "--config.data.packing=True",
        "--config.data.eval_fraction=0.1",
        "--config.data.tokenize_workers=1",
        f"--config.train.steps={steps}",
        "--config.train.batch_size=8",
        "--config.train.warmup_steps=10",
        "--config.train.log_every=10",
        f"--config.train.eval_every={steps // 3}",
        "--config.train.eval_batches=4",
        "--config.train.progress=False",
        "--config.checkpoint.every_steps=0",
    ]


def main() -> None:
    quick = "--quick" in sys.argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from experiments.sft_lora import generate
    from jaxsys import program as program_lib
    from jaxsys import train
    from jaxsys.config import load_config
    from jaxsys.data import loader
    from jaxsys.mesh import make_mesh
    from jaxsys.models import adapters
    from jaxsys.quantization import workdir as quant_workdir

    pretrain, finetune = (60, 30) if quick else (PRETRAIN, FINETUNE)
    shutil.rmtree(WORK, ignore_errors=True)
    generate.main([f"{WORK}/data", "--chats", "2000"])
    base = f"{WORK}/base"
    pre = load_config(os.path.join(HERE, "..", "..", "configs", "tiny.py"))
    pre.train.steps, pre.train.eval_every, pre.train.progress = pretrain, pretrain, False
    base_records = train.main(pre, base)  # experiments/dpo/run.py --base reuses it
    quantized = f"{WORK}/base_w4a16"
    quant_workdir.quantize_workdir(base, quantized, "w4a16", group_size=64, log=lambda *_: None)

    results: dict = {
        "pretrain_steps": pretrain,
        "finetune_steps": finetune,
        "base_stdlib_eval_loss": base_records[-1]["eval_loss"],
        "device": str(jax.devices()[0].device_kind),
        "variants": {},
    }
    for name, (rank, quant, lr) in VARIANTS.items():
        source = quantized if quant else base
        overrides = finetune_overrides(WORK, finetune) + [
            f"--config.checkpoint.init_from={source}",
            f"--config.lora.rank={rank}",
            f"--config.lora.alpha={2 * rank if rank else 16}",
            f"--config.train.lr={lr}",
        ]
        config = load_config(os.path.join(source, "config.json"), overrides)
        program = program_lib.build(config, make_mesh(config, jax.devices()[:1]))
        state = program.abstract_state()
        nbytes = lambda tree: int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
        trainable = adapters.trainable(state.params) if rank else state.params
        # held-out loss of the starting model (step 0) on the assistant tokens
        start_eval = train.evaluate(
            program,
            program.eval_loss_fn(),
            train._initial_params(program, source)[0],
            loader.load_corpus(config.data),
        )
        run_dir = f"{WORK}/{name}"
        records = train.main(config, run_dir)
        tokens_per_step = config.train.batch_size * config.data.seq_len
        step_s = [tokens_per_step / r["tokens_per_s"] for r in records if r["step"] > 1 and r["tokens_per_s"] > 0]
        evals = [(0, start_eval)] + [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        samples = chat_samples(run_dir, config)
        results["variants"][name] = {
            "lora_rank": rank,
            "base": "w4a16" if quant else "float32",
            "lr": lr,
            "eval_loss": evals,
            "final_eval_loss": evals[-1][1],
            "trainable_params": int(sum(x.size for x in jax.tree.leaves(trainable))),
            "trainable_bytes": nbytes(trainable),
            "optimizer_bytes": nbytes(state.opt_state),
            "param_bytes": nbytes(state.params),
            "step_s_median": float(np.median(step_s)),
            "samples": samples,
        }
        print(name, {k: v for k, v in results["variants"][name].items() if k != "samples"}, flush=True)
    print(save_results(HERE, results))


HELD_OUT = ["shout: river Stone", "first: quick silver window", "repeat: blue cloud"]


def chat_samples(workdir: str, config) -> dict:
    """Greedy answers to three prompts from the fine-tuned model, adapters merged (checkpoint.load)."""
    import jax

    from jaxsys import checkpoint as checkpoint_lib
    from jaxsys import tokenizer as tokenizer_lib
    from jaxsys.models import transformer

    program, params, merged = checkpoint_lib.load(workdir, checkpoint_lib.ONE_DEVICE)
    tok = tokenizer_lib.for_config(merged, workdir)
    width = 96  # a fixed row (causal attention: what follows a position does not change its logits)
    logits = jax.jit(lambda p, ids: transformer.logits(p, ids, merged.model, program.layout, program.specs))
    out = {}
    for prompt in HELD_OUT:
        ids = list(tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True))
        start = len(ids)
        while len(ids) < min(start + 32, width):  # greedy
            row = np.zeros((1, width), np.int32)
            row[0, : len(ids)] = ids
            ids.append(int(np.argmax(np.asarray(logits(params, row))[0, len(ids) - 1])))
            if tok.decode(ids[start:]).endswith("<|end|>"):
                break
        out[prompt] = tok.decode(ids[start:]).removesuffix("<|end|>")
    return out


if __name__ == "__main__":
    main()
