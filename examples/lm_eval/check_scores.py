"""lm-evaluation-harness's per-choice log-likelihoods (its --log_samples file for pystdlib_mc)
against the model's training forward (transformer.logits + log_softmax on one device).

    python examples/lm_eval/check_scores.py --workdir /tmp/srv-tiny --samples OUT/tiny/samples_pystdlib_mc_*.jsonl
"""

import argparse
import glob
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.checkpoint import load
from jaxsys.models import transformer
from jaxsys.serve.runner import check_servable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--samples", required=True, help="lm_eval's samples_pystdlib_mc_*.jsonl (a glob)")
    args = parser.parse_args()
    program, params, config = load(args.workdir, [], None, check=check_servable)
    host = jax.device_put(jax.tree.map(np.asarray, params), jax.devices()[0])
    m = config.model
    logprobs = jax.jit(lambda p, ids: jax.nn.log_softmax(transformer.logits(p, ids, m, program.layout), -1))
    worst, right = 0.0, 0
    samples = [json.loads(line) for line in open(sorted(glob.glob(args.samples))[-1])]
    for s in samples:
        text = s["doc"]["context"]  # lm-eval moves the context's trailing whitespace into each continuation
        moved, ctx = text[len(text.rstrip()) :], list(text.rstrip().encode())
        ours = []
        for choice, resp in zip(s["doc"]["choices"], s["resps"]):
            ids = ctx + list((moved + choice).encode())
            lp = np.asarray(logprobs(host, jnp.asarray([ids[:-1]], jnp.int32))[0])
            ours.append(float(sum(lp[i - 1, ids[i]] for i in range(len(ctx), len(ids)))))
            worst = max(worst, abs(ours[-1] - float(resp[0][0])))
        right += int(np.argmax(ours)) == s["doc"]["label"]
    print(
        f"{len(samples)} questions: max |lm-eval - training forward| = {worst:.2e} nats; "
        f"acc by the training forward {right / len(samples):.2f}"
    )


if __name__ == "__main__":
    main()
