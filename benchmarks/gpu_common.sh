# Sourced by the benchmarks/gpu_session*.sh scripts: the environment of a GPU session and `step`.
# The machine needs jax 0.11.2 with CUDA, optax, orbax-checkpoint, safetensors, tqdm; wheels of
# anything else (ml_collections, tensorboardX) are installed from .whl/ if that folder exists.
# kernels/ is imported as jaxsys.kernels: without a pip install, a link jaxsys/kernels -> ../kernels
# in this (scratch) copy of the tree gives the same import path (not made where jaxsys.kernels
# imports already, e.g. a checkout with its editable install: no stray link there).
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
[ -e jaxsys/kernels ] || $PY -c "import jaxsys.kernels" 2> /dev/null || ln -s ../kernels jaxsys/kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, show its tail
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - start))s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}
