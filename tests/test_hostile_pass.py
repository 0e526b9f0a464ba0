"""A hostile pass over the issue 28 fixes and the export/eval features: what broke, kept as tests."""
import json
import os
import subprocess
import sys

import pytest

from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.engine import resume as resume_mod
from basetrainer.runtime import run_folder
from tests.conftest import ToyTrainer, toy_cfg


class _CheckpointedToy(ToyTrainer):
    def build_callbacks(self, cfg, **kwargs):
        return [LossesRecorder("loss"), ModelCheckpoint(self.model, self.optimizer,
                                                        model_dir=os.path.join(cfg.work_dir, "model"),
                                                        indicator="loss", mode="min")]


def test_two_runs_started_together_do_not_both_claim_the_folder(tmp_path, monkeypatch):
    """Two processes whose run() starts in the same instant into one empty work_dir both passed
    the liveness check before either wrote its marker, and both trained into the folder (seen
    once in six real two-process starts). Here the other process claims the folder right after
    this run's check: this run must be refused, naming it, and leave its marker in place."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = str(tmp_path / "model")
        real_remove = resume_mod.atomic.remove_stale_temps

        def other_claims_meanwhile(path):   # runs after this run's liveness check, before its marker
            if path and os.path.abspath(path) == os.path.abspath(folder):
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, run_folder.MARKER), "w") as f:
                    json.dump({"run_id": "other-run", "started": "now", "pid": other.pid,
                               "host": __import__("socket").gethostname(),
                               "pid_started": run_folder._started_at(other.pid)}, f)
            return real_remove(path)

        monkeypatch.setattr(resume_mod.atomic, "remove_stale_temps", other_claims_meanwhile)
        trainer = _CheckpointedToy(toy_cfg(work_dir=str(tmp_path), num_epochs=1))
        with pytest.raises(RuntimeError, match=f"process {other.pid}"):
            trainer.run()
        assert run_folder.read_marker(folder)["run_id"] == "other-run"
        assert not os.path.exists(os.path.join(folder, "last.pth"))
    finally:
        other.kill()
        other.wait()
