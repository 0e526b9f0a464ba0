"""Crash-safe training: SIGKILL + resume, preemption, torn writes, early stop, EMA, compile,
channels_last."""
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.early_stopping import EarlyStopping
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.callbacks.model_ema import ModelEMA
from basetrainer.runtime import checkpoint
from basetrainer.metric.accuracy_recorder import AccuracyRecorder

from conftest import ToyTrainer, run_distributed, run_script, script_fixture, toy_cfg, weight_diff

PY = sys.executable

SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import StopAt, ToyTrainer, toy_cfg
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
    from basetrainer.callbacks.model_ema import ModelEMA

    if __name__ == "__main__":
        work, workers, resume, epoch, batch, sig, background = sys.argv[1:8]
        cfg = toy_cfg(num_epochs=5, batch_size=16, n_train=96, n_test=32, lr=0.1, momentum=0.9,
                      num_workers=int(workers), work_dir=work, resume=resume)
        callbacks = [LossesRecorder(), ModelEMA(decay=0.9),
                     ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss",
                                     async_save=background == "1")]
        if int(epoch) >= 0:
            callbacks.append(StopAt(int(epoch), int(batch), how=getattr(signal, sig)))
        t = ToyTrainer(cfg, callbacks=callbacks)
        t.run()
        torch.save({{"model": t.unwrapped_model.state_dict(), "ema": callbacks[1].ema,
                    "start_epoch": t.start_epoch}}, os.path.join(work, "final.pt"))
""")


script = script_fixture(SCRIPT, "train_toy.py")


def _run(script, work, workers=0, resume="", stop=(-1, -1), sig="SIGKILL", background=True):
    return run_script(script, work, workers, resume, stop[0], stop[1], sig, "1" if background else "0")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, script):
    """The script's 5-epoch run, with no stop and no workers: the final weights and EMA every
    stopped and resumed run below must end with, whatever its workers or save mode."""
    folder = tmp_path_factory.mktemp("resume_ref")
    ref = _run(script, folder / "ref")
    assert ref.returncode == 0, ref.stderr[-2000:]
    return torch.load(folder / "ref" / "final.pt", weights_only=True)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("workers,background", [(0, False), (2, False), (0, True)])
def test_sigkill_in_epoch_3_then_resume_auto_equals_uninterrupted(tmp_path, script, workers, background,
                                                                  uninterrupted):
    killed = _run(script, tmp_path / "run", workers, stop=(2, 3), sig="SIGKILL", background=background)
    assert killed.returncode == -signal.SIGKILL  # killed at step 4 of epoch 3 (of 5)
    saved = checkpoint.load_file(str(tmp_path / "run" / "model" / "last.pth"))["epoch"]
    # written before on_epoch_end returns: epoch 2's file is there; written in the background:
    # the kill may come before epoch 2's write ends, and then the whole epoch-1 file is there
    assert saved == 1 if not background else saved in (0, 1)
    resumed = _run(script, tmp_path / "run", workers, resume="auto", background=background)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = uninterrupted
    b = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert b["start_epoch"] == saved + 1
    assert weight_diff(a["model"], b["model"]) <= 1e-6
    assert weight_diff(a["ema"], b["ema"]) <= 1e-6  # the EMA is checkpointed and resumed too


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_saves_mid_epoch_and_resume_is_exact(tmp_path, script, uninterrupted):
    stopped = _run(script, tmp_path / "run", stop=(1, 2), sig="SIGTERM")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]   # the documented preemption status
    last = str(tmp_path / "run" / "model" / "last.pth")   # the message names the file and how to continue
    assert f"at epoch 1, step 3; checkpoint saved to {last}; continue with resume: auto (or --resume {last})" \
        in stopped.stderr, stopped.stderr[-2000:]
    state = checkpoint.load_file(str(tmp_path / "run" / "model" / "last.pth"))
    assert (state["epoch"], state["epoch_complete"], state["batch"]) == (1, False, 3)
    resumed = _run(script, tmp_path / "run", resume="auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    b = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert weight_diff(uninterrupted["model"], b["model"]) <= 1e-6


WRITER = textwrap.dedent("""
    import sys, torch
    from basetrainer.runtime import atomic, checkpoint
    path = sys.argv[1]
    state = {"format": checkpoint.FORMAT, "epoch": 0, "model": {"w": torch.zeros(4_000_000)}}
    atomic.atomic_save(state, path)
    print("ready", flush=True)
    i = 0
    while True:
        i += 1
        state["epoch"] = i
        state["model"]["w"].fill_(i)
        atomic.atomic_save(state, path)
""")


@pytest.mark.distributed
def test_kill_while_writing_leaves_last_pth_loadable(tmp_path):
    path = tmp_path / "last.pth"
    proc = subprocess.Popen([PY, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.5)  # many 16 MB writes are under way; kill one in the middle
    proc.kill()
    proc.wait(timeout=30)
    state = checkpoint.load_file(str(path))
    assert state["model"]["w"].shape == (4_000_000,)
    assert float(state["model"]["w"][0]) == state["epoch"]  # a whole write, not a mix
    assert checkpoint.CheckpointFolder(str(tmp_path)).find_resumable()[0] == str(path)


class _FakeLoss(Callback):
    """Writes a given test loss per epoch (what a recorder would)."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def on_epoch_end(self, epoch, logs=None):
        logs["test/loss"] = self.values[epoch]


def test_early_stop_halts_at_the_right_epoch():
    # best at epoch 1; epochs 2, 3 do not improve by more than min_delta -> stop after epoch 3
    losses = [1.0, 0.5, 0.499, 0.6, 0.1, 0.1]
    stopper = EarlyStopping("loss", patience=2, min_delta=0.01)
    t = ToyTrainer(toy_cfg(num_epochs=6, n_test=16), callbacks=[_FakeLoss(losses), stopper])
    history = t.run()
    assert [row["epoch"] for row in history.epochs] == [0, 1, 2, 3]
    assert stopper.stopped_epoch == 3 and stopper.best == 0.5


class _StopOnRank0(Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1 and self.trainer.rank == 0:
            self.trainer.stop_training = True


def _early_stop_rank(rank):
    t = ToyTrainer(toy_cfg(num_epochs=5, n_test=16, batch_size=16, distributed=True),
                   callbacks=[LossesRecorder(), _StopOnRank0()])
    return len(t.run())


@pytest.mark.distributed
@pytest.mark.slow
def test_stop_decision_is_agreed_by_every_rank(tmp_path):
    # only rank 0 asks to stop: both ranks end after epoch 1 (rank 1 would hang otherwise)
    assert run_distributed(_early_stop_rank, 2, tmp_path, timeout=120) == [2, 2]


class _WeightsAtTest(Callback):
    def on_test_begin(self, logs=None):
        self.seen = {k: v.clone() for k, v in self.trainer.unwrapped_model.state_dict().items()}


def test_ema_weights_are_what_is_evaluated():
    ema = ModelEMA(decay=0.5)
    probe = _WeightsAtTest()
    t = ToyTrainer(toy_cfg(num_epochs=1, n_train=32, batch_size=16, n_test=16), callbacks=[ema, probe])
    w0 = {k: v.clone() for k, v in t.unwrapped_model.state_dict().items()}
    steps = []
    t.callbacks.insert(0, type("Snap", (Callback,), {
        "on_batch_end": lambda self, b, logs=None: steps.append(
            {k: v.clone() for k, v in self.trainer.unwrapped_model.state_dict().items()})})())
    t.run()
    expected = {k: 0.5 * (0.5 * w0[k] + 0.5 * steps[0][k]) + 0.5 * steps[1][k] for k in w0}
    assert weight_diff(expected, probe.seen) <= 1e-6
    assert weight_diff(t.unwrapped_model.state_dict(), steps[1]) <= 1e-6  # the live weights are back after the test


def test_compile_failure_names_the_option_to_turn_it_off(monkeypatch):
    class Broken(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            raise RuntimeError("backend compiler failed")

    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken(model))
    t = ToyTrainer(toy_cfg(num_epochs=1, compile=True))
    with pytest.raises(RuntimeError, match="compile: false"):
        t.run()


def test_channels_last_inputs_train_like_contiguous():
    from torch.utils.data import TensorDataset

    class ConvNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            assert x.is_contiguous(memory_format=torch.channels_last) == self.expect_cl
            return self.fc(self.conv(x).mean((2, 3)))

    class ImgTrainer(ToyTrainer):
        def build_train_loader(self, cfg, **kwargs):
            g = torch.Generator().manual_seed(0)
            ds = TensorDataset(torch.randn(32, 3, 8, 8, generator=g), torch.arange(32) % 2)
            return self.build_dataloader(ds, cfg.batch_size, 0, phase="train")

    results = []
    for cl in (False, True):
        torch.manual_seed(0)
        model = ConvNet()
        model.expect_cl = cl
        t = ImgTrainer(toy_cfg(num_epochs=2, channels_last=cl), model=model)
        t.run()
        results.append(t.unwrapped_model.state_dict())
    assert weight_diff(results[0], results[1]) <= 1e-5
