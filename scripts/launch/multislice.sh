#!/usr/bin/env bash
# Train on several Cloud TPU slices joined by the data-centre network (multi-slice): the same command
# on every worker of every slice, with the MEGASCALE_* environment that libtpu and JAX's TPU cluster
# detection read (coordinator: worker 0 of slice 0), and config.dcn.<axis> = number of slices so
# that the mesh puts that axis's slowest factor across slices (docs/launch.md says which axis).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat >&2 <<USAGE
usage: scripts/launch/multislice.sh [--zone ZONE] [--project PROJECT] [--dcn-axis data|fsdp]
           (--prefix NODE_PREFIX --num-slices N | --slices NAME0,NAME1,...)
           CONFIG WORKDIR [--config.key=value ...]

  --prefix/--num-slices  the slices of a queued resource made with
                         gcloud compute tpus queued-resources create QR --node-count=N --node-prefix=P ...
                         (nodes P-0 ... P-(N-1))
  --slices               or the TPU VM names of the slices, slice 0 first (same accelerator type)
  --dcn-axis             the mesh axis whose slowest factor spans the slices (default: data);
                         config.mesh.<axis> must be a multiple of N (or -1). Skipped when an override
                         sets config.dcn.* itself.
  CONFIG, WORKDIR        as for tpu_pod.sh: WORKDIR on a filesystem every worker mounts at one path

example (2 x v5p-128 = 128 chips; data across slices, fsdp and tensor inside each):
  scripts/launch/multislice.sh --zone us-east5-a --prefix ms --num-slices 2 configs/llama_8b.py \\
      /mnt/shared/runs/8b --config.mesh.data=2   # fsdp=-1 (8), tensor=8 from the config
USAGE
  exit 2
}

gflags=() slices=() prefix="" num="" axis=data megascale_port=8080
while [[ $# -gt 0 && $1 == --* && $1 != --config.* ]]; do
  [[ $1 == -h || $1 == --help ]] && usage
  [[ $# -ge 2 ]] || usage
  case $1 in
    --zone|--project) gflags+=("$1" "$2") ;;
    --prefix) prefix=$2 ;;
    --num-slices) num=$2 ;;
    --slices) IFS=, read -r -a slices <<<"$2" ;;
    --dcn-axis) axis=$2 ;;
    *) echo "error: unknown option $1" >&2; usage ;;
  esac
  shift 2
done
[[ $# -ge 2 ]] || usage
if [[ -n $prefix ]]; then
  [[ ${#slices[@]} -eq 0 ]] || die "pass --prefix/--num-slices or --slices, not both"
  [[ $num =~ ^[0-9]+$ && $num -ge 2 ]] || die "--num-slices must be 2 or more with --prefix (got '${num}')"
  for ((i = 0; i < num; i++)); do slices+=("$prefix-$i"); done
fi
[[ ${#slices[@]} -ge 2 ]] || die "name the slices: --prefix P --num-slices N, or --slices A,B (2 or more)"
[[ $axis == data || $axis == fsdp ]] || die "--dcn-axis $axis: put data or fsdp across slices (their collectives are once per step and overlap); never tensor, seq or expert, whose collectives are on the critical path of every layer"
check_train_args "$@"
command -v gcloud >/dev/null || die "gcloud is not on PATH (https://cloud.google.com/sdk/docs/install)"
n=${#slices[@]}
train_args=("$@")
if ! printf '%s\n' "${@:3}" | grep -q '^--config\.dcn\.'; then
  train_args+=("--config.dcn.$axis=$n")
fi

coordinator=$(gcloud compute tpus tpu-vm describe "${slices[0]}" ${gflags[@]+"${gflags[@]}"} \
  --format='value(networkEndpoints[0].ipAddress)') || die "cannot describe slice ${slices[0]}"
[[ -n $coordinator ]] || die "slice ${slices[0]} has no network endpoint yet (is it READY?)"

tarball=$(mktemp -t jaxsys-src.XXXXXX)
pids=()
cleanup() { rm -f "$tarball"; for p in ${pids[@]+"${pids[@]}"}; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
pack_checkout "$tarball"
for s in "${slices[@]}"; do
  echo "multislice: copying $REPO to every worker of $s"
  gcloud compute tpus tpu-vm scp "$tarball" "$s:$REMOTE_TARBALL" --worker=all ${gflags[@]+"${gflags[@]}"}
done

# Every worker of every slice must start: each waits for all the others (jax.distributed, then
# megascale). One ssh per slice, in parallel; lines are prefixed with the slice.
echo "multislice: $n slices, coordinator $coordinator, --config.dcn.$axis=$n unless overridden"
command_for() {  # slice id
  printf 'export MEGASCALE_COORDINATOR_ADDRESS=%q MEGASCALE_NUM_SLICES=%q MEGASCALE_SLICE_ID=%q MEGASCALE_PORT=%q\n' \
    "$coordinator:$megascale_port" "$n" "$1" "$megascale_port"
  remote_train_command "${train_args[@]}"
}
for ((i = 0; i < n; i++)); do
  ( set -o pipefail
    gcloud compute tpus tpu-vm ssh "${slices[$i]}" --worker=all ${gflags[@]+"${gflags[@]}"} --command="$(command_for "$i")" 2>&1 |
      while IFS= read -r line; do printf '[slice %d] %s\n' "$i" "$line"; done ) &
  pids+=($!)
done
status=0
for p in ${pids[@]+"${pids[@]}"}; do wait "$p" || status=$?; done
pids=()
[[ $status -eq 0 ]] || echo "multislice: a slice failed (exit $status); the others stop when jax.distributed notices (heartbeat, ~100 s)" >&2
exit $status
