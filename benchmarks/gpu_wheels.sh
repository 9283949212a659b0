#!/usr/bin/env bash
# Fetch, on this machine (which reaches the package registries), the wheels a lent GPU machine lacks
# into .whl/; benchmarks/gpu_common.sh installs them there. The GPU image (jax 0.11.2 + CUDA 13, flax,
# optax, orbax-checkpoint, chex, jaxtyping, six, ...) lacks ml_collections and tokamax (the vendor-grade
# baseline kernels of benchmarks/gpu_kernels.sh) with tokamax's own needs. About 38 MB (xprof is 32 MB:
# `import tokamax` imports it). One version of each: two stop the whole install there.
#
#   bash benchmarks/gpu_wheels.sh          # then carry .whl in the device call
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2> /dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PY:-.venv/bin/python}
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  ml_collections==1.1.0 tokamax==0.0.17 qwix==0.1.8 einshape==1.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  typing-inspection==0.4.5 annotated-types==0.8.0 immutabledict==4.3.1 tensorboardx==2.6.5 \
  xprof==2.24.2 fire==0.7.1 termcolor==3.3.0
ls .whl
