#!/usr/bin/env bash
# Create .venv and install basetrainer (editable) with its dev extra.
# Idempotent: a second run with nothing changed prints nothing and returns at once.
#
# Environment (all optional):
#   PYTHON       the interpreter (default python3; 3.11 is the version tested)
#   VENV         the virtual environment's folder (default .venv)
#   TORCH_SPEC   the torch build to install when the venv has none (default "torch==2.14.1
#                torchvision==0.29.1": from PyPI, on Linux x86-64, the CUDA build 2.14.1+cu130 with
#                NVIDIA's CUDA libraries and triton, GPU or not: 5.2 GiB of the 6.6 GiB .venv, measured
#                2026-11-28. For the CPU-only build: TORCH_SPEC="torch==2.14.1 torchvision==0.29.1
#                --index-url https://download.pytorch.org/whl/cpu" ./setup.sh, into a new .venv)
#   EXTRAS       basetrainer's extras to install (default dev)
#   CONSTRAINTS  a pip constraints file applied to every install (CI's floor environment pins the
#                lowest versions pyproject.toml declares with .ci/floor-constraints.txt)
set -euo pipefail
cd "$(dirname "$0")"

py=${PYTHON:-python3}
venv=${VENV:-.venv}
torch_spec=${TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
extras=${EXTRAS:-dev}
constraints=${CONSTRAINTS:-}
stamp=$venv/.setup-stamp
want=$( { cat pyproject.toml setup.sh; echo "$torch_spec $extras"; if [ -n "$constraints" ]; then cat "$constraints"; fi; } \
        | sha256sum | cut -d' ' -f1)

if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

pip_args=(-q --disable-pip-version-check)
if [ -n "$constraints" ]; then
    pip_args+=(-c "$constraints")
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# each step runs only if the previous one succeeded (set -e does not apply inside "if ! { ... }")
if ! {
    { [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"; } &&
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip &&
    { "$venv/bin/python" -c "import torch, torchvision" 2>/dev/null ||
        # shellcheck disable=SC2086
        "$venv/bin/python" -m pip install "${pip_args[@]}" $torch_spec; } &&
    "$venv/bin/python" -m pip install "${pip_args[@]}" -e ".[$extras]" &&
    # a torch/torchvision pair that installs but does not import (a CUDA torchvision beside a
    # CPU torch) fails here, not in the tests
    "$venv/bin/python" -c "import torch, torchvision, basetrainer"
} >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    echo "setup.sh: installation failed (full pip output above)" >&2
    exit 1
fi
echo "$want" >"$stamp"
# what was installed and how big it is (the CUDA build of torch is most of it)
echo "setup.sh: $venv ready ($("$venv/bin/python" -c 'import torch, torchvision, basetrainer; print("torch", torch.__version__, "(CUDA " + torch.version.cuda + " build)" if torch.version.cuda else "(CPU build)", "torchvision", torchvision.__version__, "basetrainer", basetrainer.__version__)'); $(du -sh "$venv" | cut -f1) on disk)"
