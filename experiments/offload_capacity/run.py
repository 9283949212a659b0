"""Host offloading: the largest Llama-shaped model that trains on ONE chip, per offload option, by
the formula on H100 80 GB and TPU v5p (95.74 GiB), confirmed with the TPU compiler on one v5p chip.

    .venv/bin/python experiments/offload_capacity/run.py                 # formula + every option's compiles
    .venv/bin/python experiments/offload_capacity/run.py --compile none,all   # only these options
    .venv/bin/python experiments/offload_capacity/run.py --no-compile    # formula only (seconds)
    .venv/bin/python experiments/offload_capacity/run.py --replot        # tables + plot from results.json

Model family (one knob k): Llama-2 proportions, d_model = 128 k, n_layers = k, n_heads = n_kv_heads
= k (head_dim 128, multi-head like Llama-2 7B/13B), d_ff = 8/3 d rounded up to a multiple of 256,
V = 32000, untied embeddings. k = 32 is Llama-2-7B's shape (6.74B), k = 40 Llama-2-13B's (13.0B).
jaxsys defaults: fp32 parameters (the master copy), AdamW moments in fp32, bf16 compute. Batch 1 x
2048 tokens per chip, remat "full", flash attention (attention_impl "pallas", no T^2 scores).

Each compile runs in its own subprocess (`--worker`), and is appended to compiles.jsonl as it
finishes, so a long run can be resumed (`--compile` skips the points already there).
dump_peak.py shows what the device holds at the compiler's peak for one small size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from experiments import common  # noqa: E402

SEQ, BATCH, VOCAB = 2048, 1, 32000
K_RANGE = range(8, 129)
TPU_TARGET = "v5p:1x1x1"  # one v5p chip (v5p-8 is 4 chips); parses as a topology
OPTIONS = {  # name: config.offload overrides
    "none": {},
    "optimizer (device update)": {"optimizer": True, "optimizer_update": "device"},
    "optimizer (host update)": {"optimizer": True, "optimizer_update": "host"},
    "params": {"params": True},
    "activations=layer_input": {"activations": "layer_input"},
    "all (opt host + params + layer_input)": {
        "optimizer": True,
        "optimizer_update": "host",
        "params": True,
        "activations": "layer_input",
    },
}
SHORT = {
    "none": "none",
    "optimizer (device update)": "opt_dev",
    "optimizer (host update)": "opt_host",
    "params": "params",
    "activations=layer_input": "act",
    "all (opt host + params + layer_input)": "all",
}
DEFAULT_COMPILE = list(SHORT.values())


def shape(k: int) -> dict:
    d = 128 * k
    return dict(
        d_model=d,
        n_layers=k,
        n_heads=k,
        n_kv_heads=k,
        head_dim=128,
        d_ff=256 * math.ceil(8 * d / 3 / 256),
        vocab_size=VOCAB,
    )


def make_config(k: int, option: str):
    from jaxsys.config import base_config, resolve_mesh, validate

    c = base_config()
    for key, v in shape(k).items():
        c.model[key] = v
    c.model.tie_embeddings = False
    c.model.param_dtype, c.model.compute_dtype = "float32", "bfloat16"
    c.model.remat, c.model.attention_impl = "full", "pallas"
    c.data.seq_len, c.train.batch_size = SEQ, BATCH
    for axis in c.mesh:
        c.mesh[axis] = 1
    for key, v in OPTIONS[option].items():
        c.offload[key] = v
    resolve_mesh(c, 1)
    validate(c, 1)
    return c


# ----------------------------------------------------------------------------- formula


def psi(config) -> float:
    from jaxsys.analysis import cost_model

    return cost_model.zero_memory(config)["params"] / 4


def activation_estimate(config) -> dict:
    """Device bytes besides the model states, remat "full", flash attention (an estimate, stated):
    saved layer inputs  L x T x D bf16 (0 when layer_input goes to the host);
    one layer's live set  T x (8 D + 3 F) fp32 (recomputed forward + backward of one block);
    one layer's weights cast to bf16, twice (forward recompute and backward);
    logits  3 x T x V fp32 (logits, softmax, their gradient)."""
    m = config.model
    t = BATCH * SEQ
    saved = 0.0 if "layer_input" in config.offload.activations else m.n_layers * t * m.d_model * 2
    layer_w = 4 * m.d_model * m.n_heads * m.head_dim + 3 * m.d_model * m.d_ff
    return {
        "saved_layer_inputs": saved,
        "layer_live": t * (8 * m.d_model + 3 * m.d_ff) * 4,
        "layer_weights_bf16": 2 * layer_w * 2,
        "logits": 3 * t * m.vocab_size * 4,
    }


# devices that share one host's DRAM on a real machine: 8 GPUs on an H100 node, 4 chips on a v5p host
# (Cloud's v5p VMs are 2x2x1). cost_model.offload_traffic divides the host DRAM bandwidth by
# hw.host_sharers: 8 for the H100 profile, 1 for the v5p:1x1x1 slice (a one-chip slice's host).
DEVICES_PER_HOST = {"h100": 8, "v5p": 4}
PAPER_V100_BYTES = 32e9  # ZeRO-Offload's single-GPU claim: 13B on one V100 32 GB
PAPER_CLAIM_PSI = 13e9


def formula_point(k: int, option: str, hw, chip: str = "") -> dict:
    from jaxsys.analysis import cost_model

    c = make_config(k, option)
    mem = cost_model.offload_memory(c)
    act = activation_estimate(c)
    device = mem["device_total"] + sum(act.values())
    traffic = cost_model.offload_traffic(c, hw)
    p = psi(c)
    compute_s = 6 * p * BATCH * SEQ / hw.peak("bfloat16")
    # the host update alone on its host, and with the host's DRAM shared by all its devices
    alone = traffic["host_update_s"] / hw.host_sharers
    shared = alone * DEVICES_PER_HOST.get(chip, hw.devices_per_node)
    # the ratios take the host as this one device's alone (the question is one chip)
    serial = traffic["link_s"] + alone
    overlapped = max(compute_s, traffic["link_s"], alone)
    return {
        "k": k,
        "psi": p,
        "states_device": mem["device_total"],
        "states_host": mem["host_total"],
        "memory": mem,
        "activations": act,
        "activations_total": sum(act.values()),
        "device_total": device,
        "fits": device <= hw.hbm_bytes,
        "traffic": traffic,
        "host_update_s_alone": alone,
        "host_update_s_full_host": shared,
        "compute_s": compute_s,
        "overhead": serial / compute_s,  # (link + host update) / compute, nothing overlapped
        "overlapped": overlapped / compute_s - 1,  # the same when link, host and device overlap
        "tokens_to_hide": BATCH * SEQ * max(traffic["link_s"], alone) / compute_s,
    }


def hardware_profiles() -> dict:
    from jaxsys.analysis import hardware, targets

    return {"h100": hardware.PROFILES["h100"], "v5p": targets.hardware(targets.parse(TPU_TARGET))}


def formula_sweep() -> dict:
    out = {}
    for chip, hw in hardware_profiles().items():
        out[chip] = {
            "hbm_bytes": hw.hbm_bytes,
            "host_link_bytes_per_s": hw.host_link_bytes_per_s,
            "host_memory_bytes_per_s": hw.host_memory_bytes_per_s,
            "devices_per_node": hw.devices_per_node,
            "devices_per_host": DEVICES_PER_HOST[chip],
            "peak_bf16": hw.peak("bfloat16"),
            "options": {},
        }
        for option in OPTIONS:
            best = nxt = None
            for k in K_RANGE:
                pt = formula_point(k, option, hw, chip)
                if not pt["fits"]:
                    nxt = pt
                    break
                best = pt
            out[chip]["options"][option] = {"largest": best, "next": nxt}
    return out


def paper_capacity(name: str, hbm: float) -> dict:
    """ZeRO-Offload's split on `hbm` bytes, model states only and on this model family (the family's
    activation estimate with the layer inputs kept on the device, as ZeRO-Offload keeps its
    activation checkpoints on the GPU). Two readings of the split:
      2 bytes/param: the fp16 parameters; the fp16 gradients leave for the CPU in buckets during the
                     backward (the paper's arrangement; DeepSpeed: "offloading optimizer and gradient
                     states to CPU memory");
                     `cost_model.paper_zero_offload_memory`;
      4 bytes/param: fp16 parameters + fp16 gradients (the gradients counted on the device too)."""
    from jaxsys.analysis import cost_model

    per = cost_model.paper_zero_offload_memory(1.0)
    assert per["device"] == 2, per
    out = {
        "name": name,
        "hbm_bytes": hbm,
        "psi_max": hbm / 4,
        "host_bytes_at_max": hbm / per["device"] * per["host"],
        "psi_max_2": hbm / per["device"],
        "jaxsys_psi_max": {
            "none (16)": hbm / 16,
            "optimizer (8)": hbm / 8,
            "params (12)": hbm / 12,
            "all (4)": hbm / 4,
        },
        "claim_psi": PAPER_CLAIM_PSI if hbm == PAPER_V100_BYTES else None,
        "family": {},
    }
    for b in (2, 4):
        best = None
        for k in K_RANGE:
            c = make_config(k, "none")
            p = psi(c)
            if b * p + sum(activation_estimate(c).values()) > hbm:
                break
            best = {"k": k, "psi": p, "device_total": b * p + sum(activation_estimate(c).values())}
        out["family"][str(b)] = best
    return out


def compiler_boundary(res: dict) -> dict:
    """Per option, what the TPU compiler says on one v5p chip against the formula: the largest k it
    accepts with k + 1 refused (its device bytes, and the formula's at the same k), and the bytes it
    asked for at the smallest size it refused."""
    out = {}
    hbm = res["formula"]["v5p"]["hbm_bytes"]
    hw = hardware_profiles()["v5p"]
    for option in OPTIONS:
        cs = {c["k"]: c for c in res["compiles"] if c["option"] == option}
        if not cs:
            continue
        f = res["formula"]["v5p"]["options"][option]["largest"]
        rec = {
            "formula_k": f["k"],
            "formula_psi": f["psi"],
            "formula_states_bytes_per_psi": f["states_device"] / f["psi"],
            "k": None,
        }
        ok = [k for k, c in cs.items() if c["memory"]["fits"] and k + 1 in cs and not cs[k + 1]["memory"]["fits"]]
        if ok:
            c = cs[max(ok)]
            at = formula_point(c["k"], option, hw, "v5p")
            dev = c["memory"]["device"]
            rec.update(
                k=c["k"],
                psi=c["psi"],
                device_bytes=dev["peak_bytes"],
                device_argument_bytes=dev["argument_bytes"],
                device_temp_bytes=dev["temp_bytes"],
                host_bytes=c["memory"]["host"]["peak_bytes"],
                device_bytes_per_psi=dev["peak_bytes"] / c["psi"],
                formula_device_bytes_same_k=at["device_total"],
                gap_bytes=dev["peak_bytes"] - at["device_total"],
                gap_bytes_per_psi=(dev["peak_bytes"] - at["device_total"]) / c["psi"],
                psi_ratio=c["psi"] / f["psi"],
            )
        refused = sorted(k for k, c in cs.items() if not c["memory"]["fits"])
        if refused:
            c = cs[refused[0]]
            rec.update(
                refused_k=refused[0],
                refused_psi=c["psi"],
                refused_bytes=_device_bytes(c),
                refused_bytes_per_psi=_device_bytes(c) / c["psi"],
                # the compiler compiled it, but arguments + temporaries exceed the HBM
                refused_compiled="device" in c["memory"],
            )
            rec["psi_max_at_refused_rate"] = hbm / rec["refused_bytes_per_psi"]
        out[option] = rec
    return out


# ----------------------------------------------------------------------------- compile


def worker(_: int, jobs: list[dict]) -> None:
    from jaxsys.analysis import report, targets

    target = targets.parse(TPU_TARGET)
    devices = targets.devices(target)
    for job in jobs:
        config = make_config(job["k"], job["option"])
        t0 = time.time()
        r = report.target_analysis(config, target, devices)
        common.emit(
            dict(job, psi=psi(config), wall_s=time.time() - t0, compile_s=r.get("compile_s"), memory=r["memory"])
        )


def _compile(option: str, k: int, role: str, path: str) -> dict:
    t0 = time.time()
    got = common.run_worker(
        __file__, 1, [dict(option=option, k=k, role=role)], timeout=1500, what=f"{SHORT[option]} k"
    )[0]
    m = got["memory"]
    dev = m.get("device", {}).get("peak_bytes", m.get("required_bytes"))
    print(
        f"compiled {SHORT[option]} k={k} ({role}) in {time.time() - t0:.0f} s: fits={m['fits']} "
        f"device {dev / 1e9:.2f} GB",
        flush=True,
    )
    with open(path, "a") as f:
        f.write(json.dumps(got) + "\n")
    return got


def _device_bytes(c: dict) -> float:
    m = c["memory"]
    return m["device"]["peak_bytes"] if "device" in m else m["required_bytes"]


def search(sweep: dict, wanted: list[str], path: str, done: list[dict]) -> None:
    """The compiler's own boundary: from the formula's largest k, step to the largest k the TPU
    compiler accepts with k + 1 refused. A refusal (~5 s) gives the bytes needed; the next guess
    scales them by Ψ (device bytes ~ proportional to Ψ), then walks by one."""
    from jaxsys.analysis import targets

    hbm = targets.hardware(targets.parse(TPU_TARGET)).hbm_bytes
    by_short = {v: k for k, v in SHORT.items()}
    psis = {k: psi(make_config(k, "none")) for k in K_RANGE}
    for short in wanted:
        option = by_short[short]
        tried = {c["k"]: c for c in done if c["option"] == option}
        k = sweep["v5p"]["options"][option]["largest"]["k"]
        for _ in range(12):
            if k not in tried:
                tried[k] = _compile(option, k, "compiler search", path)
                done.append(tried[k])
            c = tried[k]
            if c["memory"]["fits"]:
                if k + 1 in tried and not tried[k + 1]["memory"]["fits"]:
                    break
                k += 1
            else:
                rate = _device_bytes(c) / psis[k]
                guess = max([j for j in K_RANGE if psis[j] * rate <= hbm] or [K_RANGE[0]])
                k = min(guess, k - 1)


def compile_points(sweep: dict, wanted: list[str], path: str) -> list[dict]:
    """Compile the formula's largest k and k + 1 for each wanted option (those already in `path`
    are reused)."""
    done = []
    if os.path.exists(path):
        with open(path) as f:
            done = [json.loads(line) for line in f if line.strip()]
    have = {(d["option"], d["k"]) for d in done}
    by_short = {v: k for k, v in SHORT.items()}
    for short in wanted:
        option = by_short[short]
        o = sweep["v5p"]["options"][option]
        for role, pt in (("largest by formula", o["largest"]), ("next size up", o["next"])):
            if (option, pt["k"]) not in have:
                done.append(_compile(option, pt["k"], role, path))
    return done


# ----------------------------------------------------------------------------- report


def _gb(x) -> str:
    return "—" if x is None else f"{x / 1e9:.1f}"


def tables(res: dict) -> str:
    sweep, compiles = res["formula"], res["compiles"]
    bound = res.get("compiler_boundary") or (compiler_boundary(res) if compiles else {})
    out = [
        "### 1. Largest model that fits one chip, by the formula",
        "",
        "Device = model states (`cost_model.offload_memory`) + the activation estimate. "
        "Bytes/param: the model states on the device per parameter.",
        "",
    ]
    rows = []
    for option in OPTIONS:
        b0 = sweep["v5p"]["options"][option]["largest"]
        row = [option, f"{b0['states_device'] / b0['psi']:.0f} + {b0['states_host'] / b0['psi']:.0f}"]
        for chip in ("h100", "v5p"):
            b = sweep[chip]["options"][option]["largest"]
            row += [
                b["k"],
                f"{b['psi'] / 1e9:.2f}B",
                f"{_gb(b['device_total'])} ({_gb(b['states_device'])} + {_gb(b['activations_total'])})",
                _gb(b["states_host"]),
            ]
        rows.append(row)
    out += common.markdown_table(
        [
            "option",
            "bytes/param device + host",
            "H100 80 GB: k",
            "Ψ",
            "device GB (states + act.)",
            "host GB",
            "v5p 102.8 GB: k",
            "Ψ",
            "device GB (states + act.)",
            "host GB",
        ],
        "llrrrrrrrr",
        rows,
    )
    out.append("")
    if bound:
        out += [
            "### 2. The TPU compiler's boundary on one v5p chip (v5p:1x1x1, 95.73 GiB = 102.8 GB)",
            "",
            "Largest k the compiler accepts with k + 1 refused. Gap: the compiler's device bytes minus the "
            "formula's (states + activation estimate) at the same k. Refused: the compiler's own figure "
            "for the smallest size it refused.",
            "",
        ]
        rows = []
        for option, r in bound.items():
            cells = [option, f"{r['formula_k']} ({r['formula_psi'] / 1e9:.2f}B)"]
            if r["k"] is not None:
                cells += [
                    f"{r['k']} ({r['psi'] / 1e9:.2f}B)",
                    f"{_gb(r['device_bytes'])} ({_gb(r['device_argument_bytes'])} / {_gb(r['device_temp_bytes'])})",
                    _gb(r["host_bytes"]),
                    _gb(r["formula_device_bytes_same_k"]),
                    f"+{_gb(r['gap_bytes'])} ({r['gap_bytes_per_psi']:.1f})",
                ]
            else:
                cells += ["not found", "—", "—", "—", "—"]
            if "refused_k" in r:
                note = " (compiled; args + temp over HBM)" if r["refused_compiled"] else ""
                cells.append(f"{r['refused_k']}: {_gb(r['refused_bytes'])} ({r['refused_bytes_per_psi']:.1f}){note}")
            else:
                cells.append("—")
            rows.append(cells)
        out += common.markdown_table(
            [
                "option",
                "formula: k (Ψ)",
                "compiler: k (Ψ)",
                "compiler device GB (args / temp)",
                "host GB",
                "formula device GB, same k",
                "gap GB (bytes/param)",
                "refused: k, needs GB (bytes/param)",
            ],
            "l" + "r" * 7,
            rows,
        )
        out.append("")
    if compiles:
        out += ["### 3. Every TPU compile (one v5p chip)", ""]
        rows = []
        hw = hardware_profiles()["v5p"]
        for c in sorted(compiles, key=lambda c: (list(OPTIONS).index(c["option"]), c["k"])):
            f = c.get("formula") or {"device_bytes": formula_point(c["k"], c["option"], hw, "v5p")["device_total"]}
            m = c["memory"]
            if "device" in m:
                dev = (
                    f"{_gb(m['device']['peak_bytes'])} ({_gb(m['device']['argument_bytes'])} / "
                    f"{_gb(m['device']['temp_bytes'])})"
                )
                host = (
                    f"{_gb(m['host']['peak_bytes'])} ({_gb(m['host']['argument_bytes'])} / "
                    f"{_gb(m['host']['temp_bytes'])})"
                )
                verdict = "yes" if m["fits"] else "no: compiled, over HBM"
            else:
                dev, host, verdict = f"needs {_gb(m.get('required_bytes'))}", "—", "no: refused"
            rows.append(
                [
                    c["option"],
                    c["k"],
                    f"{c['psi'] / 1e9:.2f}B",
                    c["role"],
                    _gb(f["device_bytes"]),
                    dev,
                    host,
                    f"{_device_bytes(c) / c['psi']:.1f}",
                    verdict,
                    f"{c.get('compile_s') or 0:.0f}",
                ]
            )
        out += common.markdown_table(
            [
                "option",
                "k",
                "Ψ",
                "role",
                "formula device GB",
                "compiler device GB (args / temp)",
                "compiler host GB (args / temp)",
                "device bytes/param",
                "fits",
                "compile s",
            ],
            "lrrlrrrrlr",
            rows,
        )
        out.append("")
    out += [
        "### 4. Beside ZeRO-Offload (13B on one V100 32 GB)",
        "",
        "Ψ max from the model states alone (HBM / bytes per param), and on this family with the "
        "activation estimate (largest k).",
        "",
    ]
    rows = []
    for p in res["paper"]:
        fam = lambda b: f"{p['family'][b]['k']} ({p['family'][b]['psi'] / 1e9:.1f}B)" if p["family"].get(b) else "—"
        j = p["jaxsys_psi_max"]
        rows.append(
            [
                f"{p['name']} ({_gb(p['hbm_bytes'])} GB)",
                f"{p['psi_max_2'] / 1e9:.1f}B",
                fam("2"),
                f"{p['psi_max'] / 1e9:.1f}B",
                fam("4"),
                f"{j['none (16)'] / 1e9:.1f}B",
                f"{j['optimizer (8)'] / 1e9:.1f}B",
                f"{j['params (12)'] / 1e9:.1f}B",
                f"{j['all (4)'] / 1e9:.1f}B",
            ]
        )
    out += common.markdown_table(
        [
            "memory",
            "ZeRO-Offload 2 B/param (fp16 params; grads to CPU)",
            "family: k (Ψ)",
            "4 B/param (fp16 params + grads, cost_model)",
            "family: k (Ψ)",
            "jaxsys none 16",
            "optimizer 8",
            "params 12",
            "all 4",
        ],
        "l" + "r" * 8,
        rows,
    )
    out.append("")
    out += [
        "### 5. Step-time overhead at the largest formula size (roofline)",
        "",
        "Link: host-link bytes per step (both directions summed) at the profile's one-direction bandwidth "
        "(H100 64 GB/s, v5p 32 GB/s). Host update: 28 B/param of host DRAM traffic, the host to this one device "
        "(H100 300 GB/s, v5p 200 GB/s); in brackets with the DRAM shared by the whole host (8 GPUs, 4 chips). "
        "Compute: 6ΨT / bf16 peak, T = 2048. Overhead, serial: (link + update) / compute. Overhead, "
        "overlapped: (max(compute, link, update) − compute) / compute. Tokens to hide: tokens per step at "
        "which compute covers max(link, update).",
        "",
    ]
    rows = []
    for chip in ("h100", "v5p"):
        for option in OPTIONS:
            b = sweep[chip]["options"][option]["largest"]
            t = b["traffic"]
            upd = (
                f"{b['host_update_s_alone']:.2f} ({b['host_update_s_full_host']:.2f})"
                if b["host_update_s_alone"]
                else "0"
            )
            rows.append(
                [
                    chip,
                    option,
                    f"{b['k']} ({b['psi'] / 1e9:.2f}B)",
                    _gb(t["link_bytes_total"]),
                    f"{t['link_s']:.2f}",
                    upd,
                    f"{b['compute_s']:.3f}",
                    f"{100 * b['overhead']:,.0f}%",
                    f"{100 * b['overlapped']:,.0f}%",
                    f"{b['tokens_to_hide']:,.0f}",
                ]
            )
    out += common.markdown_table(
        [
            "chip",
            "option",
            "k (Ψ)",
            "link GB/step",
            "link s",
            "host update s (full host)",
            "compute s",
            "overhead, serial",
            "overhead, overlapped",
            "tokens to hide",
        ],
        "ll" + "r" * 8,
        rows,
    )
    out.append("")
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    import numpy as np

    plt = common.pyplot()
    sweep = res["formula"]
    bound = res.get("compiler_boundary") or (compiler_boundary(res) if res["compiles"] else {})
    names = list(OPTIONS)
    x = np.arange(len(names))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    w = 0.27
    bars = [("h100", "tab:green", "H100 80 GB, formula"), ("v5p", "tab:blue", "v5p 102.8 GB, formula")]
    for i, (chip, color, label) in enumerate(bars):
        vals = [sweep[chip]["options"][o]["largest"]["psi"] / 1e9 for o in names]
        bs = ax.bar(x + (i - 1) * w, vals, w, color=color, label=label)
        for b, o in zip(bs, names):
            ax.text(
                b.get_x() + b.get_width() / 2,
                b.get_height() + 0.2,
                f"k={sweep[chip]['options'][o]['largest']['k']}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    vals = [bound[o]["psi"] / 1e9 if o in bound and bound[o]["k"] else 0 for o in names]
    bs = ax.bar(
        x + w, vals, w, color="white", edgecolor="tab:blue", hatch="///", label="v5p, TPU compiler: largest k accepted"
    )
    for b, o in zip(bs, names):
        if o in bound and bound[o]["k"]:
            ax.text(
                b.get_x() + b.get_width() / 2,
                b.get_height() + 0.2,
                f"k={bound[o]['k']}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    v100 = next(p for p in res["paper"] if p.get("claim_psi"))
    ax.axhline(v100["claim_psi"] / 1e9, ls="--", color="gray", lw=1)
    ax.text(
        -0.45,
        v100["claim_psi"] / 1e9 + 0.2,
        "ZeRO-Offload: 13B on one V100 32 GB (claim; 2 B/param on GPU)",
        fontsize=8,
        color="gray",
        va="bottom",
    )
    ax.set_xticks(x, [SHORT[n] for n in names])
    ax.set_ylabel("largest Ψ that trains on one chip (billions)")
    ax.set_title("Llama-2-shaped family, fp32 params + AdamW, batch 1 x 2048, remat full", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 0.93))
    ax.set_ylim(0, max(sweep["v5p"]["options"][o]["largest"]["psi"] for o in names) / 1e9 * 1.15)
    ax.grid(axis="y", alpha=0.3)
    offl = [o for o in names if o != "none"]
    x2 = np.arange(len(offl))
    for i, (chip, color) in enumerate((("h100", "tab:green"), ("v5p", "tab:blue"))):
        ser = [1 + sweep[chip]["options"][o]["largest"]["overhead"] for o in offl]
        ovl = [1 + sweep[chip]["options"][o]["largest"]["overlapped"] for o in offl]
        ax2.bar(
            x2 + (i - 0.5) * 0.38,
            ser,
            0.38,
            color=color,
            alpha=0.35,
            label=f"{chip}: serial (compute + link + host update)",
        )
        bs = ax2.bar(
            x2 + (i - 0.5) * 0.38, ovl, 0.38, color=color, label=f"{chip}: overlapped, max(compute, link, host update)"
        )
        for b, v, top in zip(bs, ovl, ser):
            ax2.text(
                b.get_x() + b.get_width() / 2,
                top * 1.05,
                f"{v:.0f}x" if v >= 2 else f"{v:.1f}x",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax2.axhline(1, color="k", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_ylim(0.8, 400)
    ax2.set_xticks(x2, [SHORT[n] for n in offl])
    ax2.set_ylabel("step time / compute time (log)")
    ax2.set_title("roofline at the formula's largest k, one 2048-token sequence", fontsize=10)
    ax2.legend(fontsize=7, loc="upper left")
    ax2.grid(axis="y", alpha=0.3, which="both")
    common.save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--compile",
        default=",".join(DEFAULT_COMPILE),
        help=f"options to confirm with the TPU compiler ({', '.join(SHORT.values())})",
    )
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--no-search", action="store_true", help="compile only the formula's boundary, not the compiler's own"
    )
    ap.add_argument("--replot", action="store_true")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, json.loads(sys.stdin.read()))
        return 0
    if args.replot:
        res = common.load_results(HERE)
        plot(res, os.path.join(HERE, "offload_capacity.png"))
        print(tables(res))
        return 0
    t0 = time.time()
    sweep = formula_sweep()
    print(f"formula sweep {time.time() - t0:.1f} s", flush=True)
    hws = hardware_profiles()
    paper = [paper_capacity("V100 32 GB", PAPER_V100_BYTES)] + [
        paper_capacity(name, hws[c].hbm_bytes) for c, name in (("h100", "H100 80 GB"), ("v5p", "v5p"))
    ]
    wanted = [s for s in args.compile.split(",") if s]
    compiles = [] if args.no_compile else compile_points(sweep, wanted, os.path.join(HERE, "compiles.jsonl"))
    if not args.no_compile and not args.no_search:
        search(sweep, wanted, os.path.join(HERE, "compiles.jsonl"), compiles)
    if args.no_compile and os.path.exists(os.path.join(HERE, "compiles.jsonl")):
        with open(os.path.join(HERE, "compiles.jsonl")) as f:
            compiles = [json.loads(line) for line in f if line.strip()]
    res = {
        "target": TPU_TARGET,
        "seq": SEQ,
        "batch": BATCH,
        "shapes": {k: shape(k) for k in (32, 40)},
        "formula": sweep,
        "paper": paper,
        "compiles": compiles,
    }
    hw = hardware_profiles()["v5p"]
    for c in compiles:  # the formula beside each compile (table 3)
        f = formula_point(c["k"], c["option"], hw, "v5p")
        c["formula"] = {
            "device_bytes": f["device_total"],
            "states_device": f["states_device"],
            "states_host": f["states_host"],
            "activations": f["activations_total"],
        }
        c["device_bytes_per_psi"] = _device_bytes(c) / c["psi"]
    res["compiler_boundary"] = compiler_boundary(res) if compiles else {}
    res["compile_wall_s"] = sum(c.get("wall_s", 0.0) for c in compiles)  # the compiles' own, whenever run
    res["seconds"] = time.time() - t0  # this run
    common.save_results(HERE, res)
    try:
        plot(res, os.path.join(HERE, "offload_capacity.png"))
    except ImportError:
        print("matplotlib missing: no plot")
    print(tables(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
