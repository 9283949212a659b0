"""What a configuration costs, before and beside running it (docs/analysis.md, docs/planner.md).

    hardware     the one table of hardware facts: device profiles (peaks per dtype, HBM, links,
                 host, latencies, async collectives), TPU chips, GPU descriptions, device lookup,
                 the job peak that every MFU divides by
    flops        model FLOPs per token
    cost_model   the papers' closed forms: collectives, ZeRO memory, activations, the roofline,
                 the planner's step model
    collectives, hlo   reading lowered and compiled programs: collectives, trip counts, overlap
    report       the analysis of a config's compiled train step (or forward), and its tables
    targets      accelerator targets (TPU slices, GPU nodes): names, topologies, compilers
    decode       the decode analysis and the serving step's roofline (`DecodeStep`)
    serving      the serving cost model: engine step time, disaggregated placement
    planner      the layout planner: enumerate, prune, rank, compile the best
    inputs       the checks of what `jaxsys analyze` / `jaxsys plan` were asked for

The commands `jaxsys analyze` (jaxsys/analyze.py) and `jaxsys plan` (jaxsys/plan.py) parse
their flags and call into this package.
"""
