#!/usr/bin/env bash
# Create .venv and install basetrainer (editable) with its dev extra.
# Idempotent: a second run with nothing changed prints nothing and returns at once.
# PYTHON picks the interpreter (default python3, 3.9 or newer); TORCH_SPEC the torch build to
# install when the venv has none (default: the release that lies on this machine's disk, so pip
# does not download a CUDA build of several GB).
set -euo pipefail
cd "$(dirname "$0")"

py=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)

if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! {
    [ -x .venv/bin/python ] || "$py" -m venv .venv
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
        # shellcheck disable=SC2086
        .venv/bin/python -m pip install -q --disable-pip-version-check $torch_spec
    fi
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
} >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    echo "setup.sh: installation failed (full pip output above)" >&2
    exit 1
fi
echo "$want" >"$stamp"
echo "setup.sh: .venv ready ($(.venv/bin/python -c 'import torch, basetrainer; print("torch", torch.__version__, "basetrainer", basetrainer.__version__)'))"
