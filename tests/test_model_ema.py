"""ModelEMA with ModelCheckpoint: a weights file whose name states a figure holds the weights
that gave it (the average when the test phase ran on it), in one process, after a resume, with
the background writer, and under DDP and FSDP (2 gloo ranks)."""
import glob
import os
import re

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.callbacks.model_ema import ModelEMA
from basetrainer.runtime import comm

from conftest import StopAt, TinyNet, ToyTrainer, run_distributed, toy_cfg, weight_diff
from fsdp_common import BlockNet, BlockTrainer, fsdp_cfg

NAMED = re.compile(r"(?:best_model|model)_(\d{3})_(-?\d+\.\d{4})\.pth")


def noisy_blobs(n, seed, num_classes=4, dim=16):
    """Overlapping blobs: the test loss stays far from 0, so 4 decimals tell weights apart."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(1234))
    y = torch.arange(n) % num_classes
    return TensorDataset(centres[y] + 1.5 * torch.randn(n, dim, generator=g), y)


class NoisyData:
    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(noisy_blobs(cfg.n_train, 0), cfg.batch_size, 0, phase="train", shuffle=True)

    def build_test_loader(self, cfg, **kwargs):
        return self.build_dataloader(noisy_blobs(cfg.n_test, 1), cfg.batch_size, 0, phase="test", shuffle=False)


class NoisyToy(NoisyData, ToyTrainer):
    pass


class NoisyBlocks(NoisyData, BlockTrainer):
    pass


def evaluate(weights_file, model, n_test, data=None):
    """The sample-weighted test loss of ``weights_file`` on ``data`` (default: the test set of
    the trainers here)."""
    model.load_state_dict(torch.load(weights_file, weights_only=True))
    x, y = (data if data is not None else noisy_blobs(n_test, 1)).tensors
    model.eval()
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y, reduction="sum") / len(y))


def named_files(folder):
    """``{file name: (epoch, figure in the name)}`` of the weights files in ``folder``."""
    out = {}
    for path in glob.glob(os.path.join(folder, "*.pth")):
        match = NAMED.fullmatch(os.path.basename(path))
        if match:
            out[os.path.basename(path)] = (int(match.group(1)), float(match.group(2)))
    return out


def assert_files_reproduce_their_names(folder, make_model, n_test, figures, data=None):
    """Every weights file evaluates to the figure in its name, and to ``figures[epoch]`` (the
    run's test loss of that epoch) where given (on ``data``, default the test set here)."""
    files = named_files(folder)
    assert any(name.startswith("best_model_") for name in files), sorted(os.listdir(folder))
    for name, (epoch, figure) in sorted(files.items()):
        got = evaluate(os.path.join(folder, name), make_model(), n_test, data)
        assert got == pytest.approx(figure, abs=5.1e-5), (name, got)          # the name's rounding
        if epoch in figures:
            assert got == pytest.approx(figures[epoch], rel=1e-5), (name, got)   # the epoch's figure
    return files


def losses(history, first_epoch=0):
    return {first_epoch + i: row["test/loss"] for i, row in enumerate(history)}


def _run(work, evaluate=True, epochs=4, resume="", extra=(), async_save=True, decay=0.7, **cfg):
    callbacks = [ModelEMA(decay=decay, evaluate=evaluate), LossesRecorder(),
                 ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss", async_save=async_save),
                 *extra]
    cfg = toy_cfg(num_epochs=epochs, n_train=64, n_test=32, lr=0.05, work_dir=work, resume=resume, **cfg)
    t = NoisyToy(cfg, callbacks=callbacks)
    return t, t.run().epochs


def test_weights_files_of_an_ema_evaluated_run_reproduce_the_figure_in_their_names(tmp_path):
    work = str(tmp_path / "ema")
    t, history = _run(work)   # the background writer: the average goes on changing while it writes
    files = assert_files_reproduce_their_names(os.path.join(work, "model"), TinyNet, 32, losses(history))
    assert len(files) == 5   # 4 epochs + the best (the last epoch: the loss falls)
    # the live weights give another figure: the files are the average's, not a copy of the model
    live = {k: v.clone() for k, v in t.unwrapped_model.state_dict().items()}
    torch.save(live, tmp_path / "live.pth")
    assert abs(evaluate(tmp_path / "live.pth", TinyNet(), 32) - history[-1]["test/loss"]) > 1e-3
    # last.pth keeps the live weights (what training goes on from) and the average beside them
    state = torch.load(os.path.join(work, "model", "last.pth"), weights_only=True)
    assert all(torch.equal(state["model"][k], live[k]) for k in live)
    best = torch.load(os.path.join(work, "model", next(n for n in files if n.startswith("best_"))), weights_only=True)
    assert all(torch.equal(best[k], state["callbacks"]["ModelEMA"]["ema"][k]) for k in best)


def test_without_ema_evaluation_the_files_hold_the_live_weights(tmp_path):
    work = str(tmp_path / "live")
    t, history = _run(work, evaluate=False, async_save=False)
    files = assert_files_reproduce_their_names(os.path.join(work, "model"), TinyNet, 32, losses(history))
    best = next(n for n in files if n.startswith("best_"))
    saved = torch.load(os.path.join(work, "model", best), weights_only=True)
    assert weight_diff(saved, t.unwrapped_model.state_dict()) == 0.0


def test_after_a_resume_mid_run_the_files_still_reproduce_their_names(tmp_path):
    work = str(tmp_path / "resumed")
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        _run(work, epochs=5, extra=[StopAt(2, 1)])   # inside epoch 2: resumed from the end of epoch 1
    _, history = _run(work, epochs=5, resume="auto")
    assert len(history) == 3   # epochs 2, 3, 4
    files = assert_files_reproduce_their_names(os.path.join(work, "model"), TinyNet, 32, losses(history, 2))
    assert sorted(e for e, _ in files.values()) == [0, 1, 2, 3, 4, 4]


class ExampleStyle(NoisyToy):
    """Callbacks as examples/example.py builds them (ModelCheckpoint given the trainer's model),
    with the average after the checkpoint in the list."""

    def build_callbacks(self, cfg, **kwargs):
        return [LossesRecorder(),
                ModelCheckpoint(model=self.model, optimizer=self.optimizer,
                                moder_dir=os.path.join(cfg.work_dir, "model"), epochs=cfg.num_epochs,
                                indicator="loss", start_save=0),   # no per-epoch files
                ModelEMA(decay=0.7)]


def test_the_example_style_checkpoint_after_the_average_holds_the_average_too(tmp_path):
    cfg = toy_cfg(num_epochs=3, n_train=64, n_test=32, lr=0.05, work_dir=str(tmp_path))
    history = ExampleStyle(cfg).run().epochs
    files = assert_files_reproduce_their_names(str(tmp_path / "model"), TinyNet, 32, losses(history))
    assert [name for name in files if name.startswith("model_")] == []
    assert len(files) == 1


def test_two_averages_that_both_evaluate_are_refused(tmp_path):
    callbacks = [ModelEMA(decay=0.9), LossesRecorder(), ModelEMA(decay=0.99)]
    t = ToyTrainer(toy_cfg(num_epochs=1, n_train=32, n_test=16, work_dir=str(tmp_path)), callbacks=callbacks)
    before = {k: v.clone() for k, v in t.unwrapped_model.state_dict().items()}
    with pytest.raises(ValueError, match=r"2 ModelEMA callbacks evaluate.*swapped in over the first.*evaluate=False"):
        t.run()
    assert weight_diff(before, t.unwrapped_model.state_dict()) == 0.0   # nothing trained


# ----------------------------------------------------------------------------- DDP and FSDP
def _sharded(rank, work):
    out = {}
    for strategy in ("ddp", "fsdp"):
        folder = os.path.join(work, strategy)
        callbacks = [LossesRecorder(), ModelEMA(decay=0.7, evaluate=True),
                     ModelCheckpoint(model_dir=os.path.join(folder, "model"), indicator="loss")]
        cfg = fsdp_cfg(strategy=strategy, work_dir=folder, num_epochs=3, n_test=31)
        out[strategy] = NoisyBlocks(cfg, callbacks=callbacks).run().epochs
    comm.synchronize()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_under_ddp_and_fsdp_the_best_file_is_the_evaluated_average(tmp_path):
    ranks = run_distributed(_sharded, 2, tmp_path, str(tmp_path), timeout=300)
    for strategy in ("ddp", "fsdp"):
        history = ranks[0][strategy]
        assert ranks[1][strategy] == history
        files = assert_files_reproduce_their_names(str(tmp_path / strategy / "model"), BlockNet, 31, losses(history))
        assert len(files) == 4, (strategy, sorted(files))
