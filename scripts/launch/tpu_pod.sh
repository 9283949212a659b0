#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM pod slice (one process per host; they find each other
# through the TPU metadata: jaxsys.mesh.maybe_initialize_distributed -> jax.distributed.initialize()).
# Run from a machine with gcloud configured; nothing is needed on the workers beforehand.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat >&2 <<USAGE
usage: scripts/launch/tpu_pod.sh [--zone ZONE] [--project PROJECT] TPU_NAME CONFIG WORKDIR [--config.key=value ...]

  TPU_NAME  an existing TPU VM (gcloud compute tpus tpu-vm create NAME --accelerator-type=v5p-64 ...)
  CONFIG    configs/<name>.py[:arg], relative to this checkout (copied to ~/jaxsys on every worker)
  WORKDIR   metrics and checkpoints: a path every worker sees the same (NFS/Filestore or gcsfuse
            mount); a relative path is under ~/jaxsys on each worker's own disk (no shared checkpoint)

example:
  scripts/launch/tpu_pod.sh --zone us-east5-a my-v5p-64 configs/llama_1b.py /mnt/shared/runs/1b \\
      --config.train.steps=1000   # llama_1b: fsdp=-1, over all 32 chips
USAGE
  exit 2
}

gflags=()
while [[ $# -gt 0 && $1 == --* && $1 != --config.* ]]; do
  case $1 in
    --zone) [[ $# -ge 2 ]] || usage; gflags+=(--zone "$2"); shift 2 ;;
    --zone=*|--project=*) gflags+=("$1"); shift ;;
    --project) [[ $# -ge 2 ]] || usage; gflags+=(--project "$2"); shift 2 ;;
    -h|--help) usage ;;
    *) echo "error: unknown option $1" >&2; usage ;;
  esac
done
[[ $# -ge 3 ]] || usage
name=$1; shift
check_train_args "$@"
command -v gcloud >/dev/null || die "gcloud is not on PATH (https://cloud.google.com/sdk/docs/install)"

tarball=$(mktemp -t jaxsys-src.XXXXXX)
trap 'rm -f "$tarball"' EXIT
pack_checkout "$tarball"
echo "tpu_pod: copying $(du -h "$tarball" | cut -f1) of $REPO to every worker of $name"
gcloud compute tpus tpu-vm scp "$tarball" "$name:$REMOTE_TARBALL" --worker=all ${gflags[@]+"${gflags[@]}"}

# --worker=all runs the command on all workers at once: they must all start, since each one waits
# for the others in jax.distributed.initialize. Process 0's lines start with "jaxsys: ".
echo "tpu_pod: starting jaxsys.train on every worker of $name"
gcloud compute tpus tpu-vm ssh "$name" --worker=all ${gflags[@]+"${gflags[@]}"} \
  --command="$(remote_train_command "$@")"
