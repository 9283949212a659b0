# Shared by tpu_pod.sh and multislice.sh (sourced, not run): argument checks, packing this checkout,
# and the command every TPU worker runs.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
REMOTE_DIR=jaxsys          # on each worker, under $HOME
REMOTE_TARBALL=jaxsys-src.tgz

die() { echo "error: $*" >&2; exit 2; }

# check_train_args CONFIG WORKDIR [OVERRIDE...]: what jaxsys.train would reject, rejected here
# before any TPU time is spent.
check_train_args() {
  local config=$1 workdir=$2; shift 2
  [[ $config != -* && -n $config ]] || die "CONFIG is missing (e.g. configs/tiny.py or configs/llama_1b.py:cpu)"
  [[ $workdir != -* && -n $workdir ]] || die "WORKDIR is missing"
  local file=${config%%:*}
  [[ $file == /* || -f $REPO/$file ]] || die "$file is not a file of this checkout ($REPO); pass a path relative to it"
  [[ $workdir == gs://* ]] && die "WORKDIR $workdir: jaxsys writes its workdir with POSIX file calls, so gs:// does not work; use a filesystem every worker mounts at the same path (Filestore/NFS, or gcsfuse), see docs/launch.md"
  local o
  for o in "$@"; do
    [[ $o == --config.* ]] || die "unrecognised argument '$o': overrides look like --config.train.steps=10"
  done
}

# pack_checkout OUT.tgz: the files git knows here (tracked, and untracked but not ignored), as they
# are in the working tree, so that uncommitted changes run too; .venv, runs/ and caches stay behind.
pack_checkout() {
  local out=$1
  command -v git >/dev/null || die "git is needed to pack the checkout"
  (cd "$REPO" && git ls-files -z -co --exclude-standard |
     while IFS= read -r -d '' f; do [[ -e $f ]] && printf '%s\0' "$f"; done |
     tar --null -T - -czf "$out") || die "could not pack $REPO"
}

# q ARG...: the arguments quoted for the remote bash.
q() { printf '%q ' "$@"; }

# remote_train_command CONFIG WORKDIR [OVERRIDE...]: unpack the checkout, make .venv with Python 3.12
# and jaxsys[tpu] once (again when pyproject.toml changes), then train. TPU VM images ship Python 3.10;
# uv provides 3.12 where the image has none.
remote_train_command() {
  cat <<REMOTE
set -euo pipefail
mkdir -p ~/$REMOTE_DIR && tar -xzf ~/$REMOTE_TARBALL -C ~/$REMOTE_DIR && cd ~/$REMOTE_DIR
if [ ! -x .venv/bin/python ]; then
  py=\$(command -v python3.12 || true)
  if [ -z "\$py" ]; then
    export PATH=\$HOME/.local/bin:\$PATH
    command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
    uv python install 3.12 >/dev/null
    py=\$(uv python find 3.12)
  fi
  "\$py" -m venv .venv
fi
if ! cmp -s pyproject.toml .venv/.jaxsys-pyproject; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[tpu]"
  cp pyproject.toml .venv/.jaxsys-pyproject
fi
exec .venv/bin/python -m jaxsys.train $(q --config "$1" --workdir "$2" "${@:3}")
REMOTE
}
