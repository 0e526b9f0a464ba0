"""GPU tests: every check of the GPU kit (tools/gpukit, run on a GPU machine by
``tools/gpu_check.sh OUT_DIR``) as a pytest test on cuda:0, under the ``gpu`` marker.

Without CUDA they skip; ``BASETRAINER_REQUIRE_GPU=1`` makes a missing GPU a failure instead.
The checks are plain functions (no pytest: the GPU machine has none); their CPU sides run in
the kit's dry run (tests/test_gpu_kit.py), which CI runs."""
import os
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
from gpukit import registry  # noqa: E402

CHECKS = registry.load_all()


def _params():
    for check in CHECKS.values():
        marks = [pytest.mark.gpu, pytest.mark.slow] + ([pytest.mark.distributed] if check.processes else [])
        yield pytest.param(check.name, marks=marks, id=check.name)


@pytest.mark.parametrize("name", list(_params()))
def test_gpu(name, tmp_path):
    if not torch.cuda.is_available():
        if os.environ.get("BASETRAINER_REQUIRE_GPU") == "1":
            pytest.fail("BASETRAINER_REQUIRE_GPU=1 and this machine has no CUDA device")
        pytest.skip("no CUDA device (BASETRAINER_REQUIRE_GPU=1 makes this a failure)")
    try:
        CHECKS[name].fn(registry.Context(torch.device("cuda", 0), str(tmp_path)))
    except registry.Skip as e:
        pytest.skip(str(e))
