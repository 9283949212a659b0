"""Greedy continuations of the Hugging Face golden models by `transformers`, for jaxsys.generate.

For each tiny model in tests/golden/hf_llama/<name>/ (made by scripts/make_hf_golden.py; NAMES),
load it with `AutoModelForCausalLM.from_pretrained` (fp32, eager attention), take the first 8 tokens of each
row of its tokens.npy as prompts and let `model.generate(do_sample=False, use_cache=True)` add 16
tokens. Writes greedy_prompts.npy [2, 8] and greedy_tokens.npy [2, 16] (int32) beside the model.

Environment: the Python 3.11 venv described in scripts/make_hf_golden.py. Run from the repository root:

    /tmp/hfvenv/bin/python scripts/make_hf_greedy_golden.py
"""

import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "golden", "hf_llama")
PROMPT, NEW = 8, 16
# Llamas; and the models whose decoding a sliding window (mistral 8, phi3 10, gemma 6: shorter
# than the 24 tokens), Gemma 2's soft-capping, Gemma 3's pieces or a mixture of experts (Qwen2-MoE:
# with its gated shared expert) changes; DeepSeek-V2 / V3's latent attention (transformers caches the
# latents) and routing
NAMES = (
    "untied",
    "tied",
    "mistral",
    "phi3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
)


def main() -> None:
    torch.manual_seed(0)
    for name in NAMES:
        path = os.path.join(ROOT, name)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        prompts = np.load(os.path.join(path, "tokens.npy"))[:, :PROMPT].astype(np.int64)
        with torch.no_grad():
            out = model.generate(
                torch.from_numpy(prompts),
                attention_mask=torch.ones_like(torch.from_numpy(prompts)),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
                eos_token_id=None,
            )
        new = out[:, PROMPT:].numpy().astype(np.int32)
        np.save(os.path.join(path, "greedy_prompts.npy"), prompts.astype(np.int32))
        np.save(os.path.join(path, "greedy_tokens.npy"), new)
        print(name, new.tolist())


if __name__ == "__main__":
    main()
