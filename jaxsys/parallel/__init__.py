"""The parallel strategies. Every collective of a training step is written in this package, under
the name of the technique it belongs to: `tensor` (Megatron TP and SP; `collective_matmul`, SP's
all-gather / reduce-scatter split into ppermute steps beside the matmuls), `fsdp` (ZeRO-3 weight
gathering), `zero` (data-parallel gradient reduction and ZeRO stages 0-2), `context` (context
parallelism over `seq`: ring, all-gather, TokenRing attention and LASP-2), `galore` (the gathers
and sums of GaLore's optimizer update, jaxsys/optim/galore.py). `schedules` holds the pipeline
schedules as data (the executor over `pipe` comes next)."""
