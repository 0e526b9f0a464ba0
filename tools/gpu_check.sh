#!/usr/bin/env bash
# The GPU check kit (tools/gpukit): every GPU promise checked in one command, with the machine's
# own python3 and torch and this tree on PYTHONPATH (nothing to install, no pytest needed).
#
#   tools/gpu_check.sh OUT_DIR            # on a GPU machine (<= 8 minutes on one H100)
#   tools/gpu_check.sh OUT_DIR --cpu      # the dry run on the CPU (CI runs it: tests/test_gpu_kit.py)
#   tools/gpu_check.sh OUT_DIR --only NAME...
#
# Writes OUT_DIR/report.md and OUT_DIR/report.json; nothing outside OUT_DIR but /tmp.
# PYTHON picks another interpreter (default python3).
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [--cpu] [--only NAME...] [--deadline SECONDS]" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root:$root/tools:$root/tests:$root/bench${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1   # no __pycache__ in the tree
exec "${PYTHON:-python3}" -m gpukit "$@"
