"""The GPU kit's dry run (``tools/gpu_check.sh OUT_DIR --cpu``), so that the kit never rots:
every check passes on the CPU or is skipped because it needs CUDA or an optional package this
environment lacks; the report names the machine first; the run writes nothing outside OUT_DIR."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
from gpukit import registry  # noqa: E402

SKIPS_ALLOWED = ("needs CUDA: ", "missing package: ")


def _tree(root: str) -> set:
    """Every file under the repository but the environments, caches and git's own."""
    out = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (d.startswith(".venv") or d in (".git", ".pytest_cache", "__pycache__"))]
        out.update(os.path.relpath(os.path.join(folder, f), root) for f in files if not f.endswith(".pyc"))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_the_gpu_kit_dry_run_passes_on_the_cpu(tmp_path):
    before = _tree(ROOT)
    out = tmp_path / "kit"
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), str(out), "--cpu"], env=env,
                          capture_output=True, text=True, timeout=1500)
    report = json.loads((out / "report.json").read_text())
    lines = (out / "report.md").read_text().splitlines()
    assert lines[0] == report["headline"] and lines[0].startswith("torch ") and "CPU dry run" in lines[0], lines[0]
    bad = [(c["name"], c["status"], c["reason"][:300]) for c in report["checks"]
           if not (c["status"] == "pass" or (c["status"] == "skip" and c["reason"].startswith(SKIPS_ALLOWED)))]
    assert not bad, f"{bad}\n{done.stdout[-3000:]}"
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [c["name"] for c in report["checks"]] == list(registry.load_all()), "a check is missing from the report"
    cuda_only = {c["name"] for c in report["checks"] if c["status"] == "skip" and c["reason"].startswith("needs CUDA")}
    assert cuda_only == {"amp_fp16_gradscaler_vs_fp32", "compile_vs_eager", "pinned_batches_to_device"}, cuda_only
    assert _tree(ROOT) == before, f"the kit wrote into the tree: {sorted(_tree(ROOT) ^ before)}"
