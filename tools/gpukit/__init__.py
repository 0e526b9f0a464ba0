"""The GPU check kit (issue 32): ``tools/gpu_check.sh OUT_DIR [--cpu]``; see :mod:`gpukit.__main__`.

Checks: :mod:`.checks_train` (one device), :mod:`.checks_state` (resume, evaluate/predict,
export), :mod:`.checks_dist` (DDP, FSDP2), :mod:`.checks_speed` (bench/bench_gpu.py); how they
are declared and run: :mod:`.registry`; the report: :mod:`.report`."""
