"""Post-training weight quantization into the formats of `config.model.quant` (models/quant.py):

- `gptq`: the GPTQ algorithm (Frantar et al. 2022) on one weight matrix and its inputs' Hessian;
- `params`: a parameter tree's dense weights quantized by round to nearest or GPTQ, with GPTQ's
  layer-by-layer calibration on the config's corpus;
- `workdir`: a workdir's checkpoint quantized into a new workdir.

`python -m jaxsys.quantize` (jaxsys/quantize.py) is the command over `workdir`. The formats' matmuls
(and their reference quantizers) are in kernels/quantized_matmul/ (`jaxsys.kernels`)."""
