#!/usr/bin/env bash
# bench/.venv-peers: the peers of bench/bench_peers.py (PyTorch Lightning, Lightning Fabric,
# Accelerate, the original basetrainer 1.0.4 and the packages it imports without declaring them).
# It reads .venv's packages through a .pth line, so torch (and everything else .venv has) is the
# one tested here and is not installed twice; pip installs only what .venv lacks (checked with
# pip install --dry-run: no torch). Pinned to the versions the benchmark ran with.
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(.venv/bin/python -c "import sys; print(sys.base_prefix)")/bin/python3
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$base" -m venv bench/.venv-peers
peers_site=$(bench/.venv-peers/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$site" > "$peers_site/basetrainer-shared-venv.pth"
bench/.venv-peers/bin/python -m pip install -q lightning==2.6.6 accelerate==1.15.0 basetrainer==1.0.4 \
    pybaseutils==2.5.3 loguru==0.7.3 tensorboardX==2.6.5 pandas==3.1.1 easydict==1.14
bench/.venv-peers/bin/python -c "import torch, lightning, accelerate; print('bench/.venv-peers: torch', torch.__version__, '| lightning', lightning.__version__, '| accelerate', accelerate.__version__)"
