"""A hostile pass over issue 31's fixes, crossed with the other features: each test is a defect
found there, seen failing before its fix (the commit that fixes it says how)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from basetrainer.callbacks import losses_recorder, model_checkpoint
from basetrainer.callbacks.model_ema import ModelEMA
from basetrainer.engine import trainer
from basetrainer.metric import accuracy_recorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- toys of this file
class GreyNet(nn.Module):
    """1-channel 8x8 images -> 3 class scores, through two Conv+BatchNorm layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        return self.head(torch.relu(self.bn2(self.conv2(x))).mean((2, 3)))


def grey_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    x[:, 0, :2, :2] += y.view(-1, 1, 1).float()
    return TensorDataset(x, y)


class GreyTrainer(trainer.EngineTrainer):
    """GreyNet on grey_data, SGD, loss and accuracy recorders, ModelCheckpoint on the test loss,
    ModelEMA(decay) when ``cfg.ema_decay`` is set."""

    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        self.build(cfg)

    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(grey_data(40, 0), cfg.batch_size, 0, phase="train")

    def build_test_loader(self, cfg, **kwargs):
        return self.build_dataloader(grey_data(17, 1), cfg.batch_size, 0, phase="test", shuffle=False)

    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        return self.build_model_parallel(GreyNet(), cfg.gpu_id, distributed=cfg.distributed)

    def build_criterion(self, cfg, **kwargs):
        return nn.CrossEntropyLoss()

    def build_optimizer(self, cfg, **kwargs):
        return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def build_callbacks(self, cfg, **kwargs):
        callbacks = [losses_recorder.LossesRecorder(indicator="loss"),
                     accuracy_recorder.AccuracyRecorder(indicator="Accuracy")]
        if cfg.get("ema_decay"):
            callbacks.append(ModelEMA(decay=cfg.ema_decay))
        return callbacks + [model_checkpoint.ModelCheckpoint(model_dir=os.path.join(cfg.work_dir, "model"),
                                                             indicator="loss", start_save=None, async_save=False)]


def grey_cfg(work_dir: str, **extra) -> dict:
    return dict(work_dir=work_dir, gpu_id=[], batch_size=8, num_epochs=3, progress=False, log_freq=1,
                num_workers=0, seed=2020, **extra)


def run_ranks(tmp_path, world: int, body: str, timeout: int = 240) -> list:
    """Run ``body`` (the inside of ``def main(rank)``, with ``GreyTrainer``, ``grey_cfg`` and
    ``grey_data`` of this file at hand) on ``world`` gloo processes on 127.0.0.1; return what each
    rank's ``main`` returned (JSON)."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        import torch
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        from test_hostile_31 import GreyTrainer, grey_cfg, grey_data
        from basetrainer.engine.launch import launch
        OUT = {str(tmp_path)!r}

        def main(rank):
        {textwrap.indent(textwrap.dedent(body), "    ")}

        def worker():
            import torch.distributed as dist
            rank = dist.get_rank()
            result = main(rank)
            with open(os.path.join(OUT, f"rank{{rank}}.json"), "w") as f:
                json.dump(result, f)

        if __name__ == "__main__":
            launch(worker, num_gpus_per_machine={world}, dist_url="auto", distributed=True, args=())
    """))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


# ----------------------------------------------------------------------------- evaluate(checkpoint=) + ModelEMA
def test_evaluate_a_checkpoint_after_training_with_model_ema_evaluates_that_file(tmp_path):
    """evaluate(checkpoint=f) on a trainer whose ModelEMA holds an average (after run()) gave the
    in-memory average's figures whatever f was (the best file, named 1.1093, evaluated to 1.1566,
    the same as last.pth): ModelEMA swapped its average in over the weights just loaded."""
    work = str(tmp_path / "run")
    ema = GreyTrainer(grey_cfg(work, ema_decay=0.5))
    ema.run()
    files = sorted(f for f in os.listdir(os.path.join(work, "model")) if f.startswith("model_"))
    assert len(files) == 3
    fresh = GreyTrainer(grey_cfg(str(tmp_path / "fresh")))   # no ModelEMA: evaluates what it loads
    for name in files + ["last.pth"]:
        path = os.path.join(work, "model", name)
        assert ema.evaluate(checkpoint=path) == fresh.evaluate(checkpoint=path), name
    # the per-epoch files hold the average that gave their figure (ModelEMA evaluate=True)
    first = os.path.join(work, "model", files[0])
    assert abs(ema.evaluate(checkpoint=first)["test/loss"] - float(files[0].split("_")[-1][:-4])) < 1e-4
    # without checkpoint=, the test phase runs on the average, as in training
    assert ema.evaluate()["test/loss"] == pytest.approx(ema.history.last["test/loss"], abs=1e-7)
