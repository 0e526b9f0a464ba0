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


def test_a_contender_does_the_hand_loops_work_when_its_first_losses_agree_not_its_mean(monkeypatch):
    """On the H200 (2026-11-28) Accelerate's warm-up mean loss was 5.1 % off the hand loop's in the
    kit and 0.8 % in another process: that training is unstable, so rounding differences (its loss
    is computed outside autocast) grow by about 3x a step, while its first three losses agreed
    within 2e-4. A loop that departs only after those steps does the same work; one whose loss
    differs from the first step does not."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_gpu
    import gpu_contenders
    import torch

    class Departs(gpu_contenders.Hand):
        """The hand loop, but its weights are scaled by 1.5 after its third step (an unstable
        trajectory, compressed)."""

        def __init__(self, *args):
            super().__init__(*args)
            step = self.opt.step

            def scaled_step(*a, **k):
                out = step(*a, **k)
                self.steps = getattr(self, "steps", 0) + 1
                if self.steps == 3:
                    with torch.no_grad():
                        for p in self.model.parameters():
                            p.mul_(1.5)
                return out

            self.opt.step = scaled_step

    class Doubled(gpu_contenders.Hand):
        """Another loss: the cross-entropy counted twice (a reduction bug)."""

        def epoch(self):
            ce = torch.nn.functional.cross_entropy
            monkeypatch.setattr(torch.nn.functional, "cross_entropy", lambda *a, **k: 2 * ce(*a, **k))
            try:
                return super().epoch()
            finally:
                monkeypatch.setattr(torch.nn.functional, "cross_entropy", ce)

    sizes = dict(bench_gpu.SIZES)
    sizes["small_resnet_b512"] = (sizes["small_resnet_b512"][0], (4, 8, 10, 8, 1))   # 8 steps: 5 after the scaling
    monkeypatch.setattr(bench_gpu, "SIZES", sizes)
    monkeypatch.setattr(gpu_contenders, "PEERS", [("departs", Departs), ("doubled", Doubled)])
    figure = bench_gpu.model_case("small_resnet_b512", torch.device("cpu"), dry=True, peers=True)
    assert figure["departs"]["first_losses_rel"] < 1e-6, figure["departs"]
    assert figure["doubled"]["first_losses_rel"] > 10 * bench_gpu.SAME_WORK, figure["doubled"]   # 1.29 on the CPU
