"""The parallel strategies. Every collective jaxsys runs is written in this package, under the
name of the technique it belongs to, and `spmd.per_shard` is the one place a shard_map is built:

    spmd              per_shard: per-device code over the whole mesh (every step function)
    collectives       collectives with their backward stated (custom_vjp): Megatron's f / g, ...
    tensor            Megatron tensor and sequence parallelism; vocabulary-parallel embedding,
                      cross-entropy and logits
    collective_matmul SP's all-gather / reduce-scatter split into ppermute steps beside the matmuls
    fsdp              FSDP / ZeRO-3: a layer's weights gathered before use
    fsdp_prefetch     FSDP prefetch: layer i+1 gathered during layer i, the delayed reduce-scatter
    zero              data-parallel gradient reduction and ZeRO stages 0-2
    context           context parallelism over `seq`: ring, all-gather, TokenRing, LASP-2
    pipeline          the pipeline executor over `pipe` (lockstep ticks, per-stage VJPs);
                      schedules: GPipe, 1F1B, interleaved, ... as data
    expert            expert parallelism: all-to-all dispatch; expert_placement: balanced placement
    offload           host offloading of state, parameters and activations (memory kinds)
    galore            the gathers and sums of GaLore's optimizer update (jaxsys/optim/galore.py)
    muon              the all-to-alls that hand each device whole matrices for Muon's
                      Newton-Schulz (jaxsys/optim/muon.py)
    diloco            DiLoCo's average of the islands' outer gradients over `data` (f32 all-reduce, or
                      an all-gather of quantized codes; jaxsys/optim/outer.py)
    zeropp            ZeRO++: hpZ's secondary gather, qwZ / qgZ's quantized collectives
    process_ring      a buffer to the next process over the devices (snapshot peer copies)
"""
