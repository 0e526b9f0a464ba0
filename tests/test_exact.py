"""A DDP or resumed run equals the plain run on ordinary data: data sets that do not divide by
the ranks or the batch, random augmentation in worker processes, resumes inside an epoch and
inside an accumulation window."""
import csv
import os
import signal
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from basetrainer.runtime import comm

from conftest import ToyTrainer, blobs, run_distributed, run_script, script_fixture, toy_cfg, weight_diff

class Counted(Callback):
    """Counts the samples this rank trained on (from on_train_summary), per epoch."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self.counts[epoch] = self.counts.get(epoch, 0) + int(inputs[0].shape[0])


class UnevenTrainer(ToyTrainer):
    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(blobs(cfg.n_train, 4, seed=0), cfg.batch_size, 0, phase="train",
                                     shuffle=True, drop_last=cfg.drop_last)


CASES = [  # (samples, global batch, drop_last)
    (251, 30, False), (251, 30, True), (241, 30, False), (241, 30, True)]


def _train_cases(rank, cases, bn=False):
    out = []
    for n, batch, drop_last in cases:
        counted = Counted()
        t = UnevenTrainer(toy_cfg(num_epochs=3, n_train=n, batch_size=batch, drop_last=drop_last, lr=0.2,
                                  momentum=0.9, bn=bn, sync_bn=bn, distributed=comm.get_world_size() > 1),
                          callbacks=[LossesRecorder(), AccuracyRecorder(), counted])
        history = t.run()
        total = sum(comm.all_gather_object(counted.counts.get(0, 0)))
        out.append({"weights": {k: v.detach().clone() for k, v in t.unwrapped_model.state_dict().items()},
                    "history": history.epochs, "samples": total})
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_equals_one_process_on_data_that_does_not_divide(tmp_path, world):
    single = _train_cases(0, CASES)
    ranks = run_distributed(_train_cases, world, tmp_path, CASES, timeout=300)
    for (n, batch, drop_last), one, *many in zip(CASES, single, *ranks):
        kept = n // batch * batch if drop_last else n
        assert one["samples"] == kept          # every sample once, no padding, no duplicate
        for r in many:
            assert r["samples"] == kept
            assert weight_diff(one["weights"], r["weights"]) < 1e-5, (n, batch, drop_last, world)
            for a, b in zip(one["history"], r["history"]):   # the train figures count each sample once
                assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-5)
                assert b["train/Accuracy"] == pytest.approx(a["train/Accuracy"], abs=1e-9)


class DropLastTestTrainer(ToyTrainer):
    def build_test_loader(self, cfg, **kwargs):
        return self.build_dataloader(blobs(cfg.n_test, 4, seed=1), cfg.batch_size, 0, phase="test", shuffle=False,
                                     drop_last=True)


class CountedTest(Callback):
    def __init__(self):
        super().__init__()
        self.samples = 0

    def on_test_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self.samples += int(inputs[0].shape[0])


def _test_with_drop_last(rank):
    counted = CountedTest()
    t = DropLastTestTrainer(toy_cfg(num_epochs=1, n_train=30, n_test=101, batch_size=10,
                                    distributed=comm.get_world_size() > 1),
                            callbacks=[LossesRecorder(), AccuracyRecorder(), counted])
    history = t.run()
    return {"history": history.epochs, "samples": sum(comm.all_gather_object(counted.samples))}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_test_loader_with_drop_last_drops_the_global_batch_in_ddp_too(tmp_path):
    # 101 test samples, batch 10: one process evaluates 100; 3 ranks (batch 3 each) once dropped
    # their own incomplete batches and evaluated 99, so test/loss differed (0.3587 against 0.3618)
    single = _test_with_drop_last(0)
    ranks = run_distributed(_test_with_drop_last, 3, tmp_path, timeout=300)
    assert single["samples"] == 100
    for r in ranks:
        assert r["samples"] == 100
        assert r["history"][0]["test/loss"] == pytest.approx(single["history"][0]["test/loss"], rel=1e-6)
        assert r["history"][0]["test/Accuracy"] == single["history"][0]["test/Accuracy"]


def _train_cases_float64(rank, cases):
    torch.set_default_dtype(torch.float64)
    try:
        return _train_cases(rank, cases, True)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_with_sync_batchnorm_equals_one_process_on_data_that_does_not_divide(tmp_path, world):
    # 242: the last batch has two samples, so with 3 ranks one of them holds none (BatchNorm in one
    # process cannot train on a batch of one sample, so 241 would make no reference). In float64,
    # so that what is compared is the algorithm: in float32 the rounding of 27 BatchNorm steps
    # alone moves the weights by about 2e-5 (3 ranks), while in float64 they agree within 1e-12.
    cases = [(251, 30, False), (242, 30, False)]
    single = _train_cases_float64(0, cases)
    ranks = run_distributed(_train_cases_float64, world, tmp_path, cases, timeout=300)
    for (n, batch, _), one, *many in zip(cases, single, *ranks):
        for r in many:   # weights and BatchNorm's running statistics
            assert weight_diff(one["weights"], r["weights"]) < 1e-9, (n, batch, world)


def test_loss_reduction_sum_trains_like_the_mean():
    class SumTrainer(UnevenTrainer):
        def run_step(self, inputs):
            x, y = inputs
            out = self.model(x)
            return out, nn.functional.cross_entropy(out, y, reduction="sum")

    cfg = dict(num_epochs=2, n_train=70, batch_size=16, drop_last=False, lr=0.2, momentum=0.9, accumulate_steps=2)
    mean = UnevenTrainer(toy_cfg(**cfg), callbacks=[LossesRecorder()])
    mean_history = mean.run()
    summed = SumTrainer(toy_cfg(loss_reduction="sum", **cfg), callbacks=[LossesRecorder()])
    sum_history = summed.run()
    assert weight_diff(mean.unwrapped_model.state_dict(), summed.unwrapped_model.state_dict()) < 1e-6
    assert sum_history["train/loss"] == pytest.approx(mean_history["train/loss"], rel=1e-6)


# ----------------------------------------------------------------------------- augmentation, resumes
SCRIPT = textwrap.dedent("""
    import os, random, signal, sys
    import numpy as np, torch
    sys.path.insert(0, {tests!r})
    from torch.utils.data import Dataset
    from conftest import StopAt, ToyTrainer, blobs, toy_cfg
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.callbacks.log_history import LogHistory
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

    class Augmented(Dataset):
        # random noise from torch, numpy and python's random, as augmentations draw it
        def __init__(self):
            self.data = blobs(100, 4, seed=0)
        def __len__(self):
            return len(self.data)
        def __getitem__(self, i):
            x, y = self.data[i]
            return x + 0.3 * torch.randn(16) + 0.2 * float(np.random.rand()) - 0.2 * random.random(), y

    class Trainer(ToyTrainer):
        def build_train_loader(self, cfg, **kwargs):
            return self.build_dataloader(Augmented(), cfg.batch_size, cfg.num_workers, phase="train",
                                         persistent_workers=cfg.persistent)

    if __name__ == "__main__":
        work, workers, persistent, accumulate, resume, epoch, batch = sys.argv[1:8]
        cfg = toy_cfg(num_epochs=3, batch_size=16, lr=0.1, momentum=0.9, num_workers=int(workers),
                      persistent=persistent == "1", accumulate_steps=int(accumulate), work_dir=work,
                      resume=resume, log_freq=3)
        callbacks = [LossesRecorder(), LogHistory(log_dir=os.path.join(work, "log"), log_freq=3),
                     ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss", save_freq_steps=1,
                                     async_save=False)]
        if int(epoch) >= 0:
            callbacks.append(StopAt(int(epoch), int(batch), how=signal.SIGKILL))
        t = Trainer(cfg, callbacks=callbacks)
        t.run()
        torch.save(t.unwrapped_model.state_dict(), os.path.join(work, "final.pt"))
""")


script = script_fixture(SCRIPT, "augmented.py")


def _run(script, work, workers=0, persistent=True, accumulate=1, resume="", kill=(-1, -1)):
    return run_script(script, work, workers, "1" if persistent else "0", accumulate, resume, kill[0], kill[1])


def _final(work):
    return torch.load(os.path.join(str(work), "final.pt"), weights_only=True)


def _history(work):
    with open(os.path.join(str(work), "log", "history.csv"), newline="") as f:
        return [{k: v for k, v in row.items() if k != "epoch_time" and not k.startswith("data_wait")}   # timings
                for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, script):
    """The augmenting script's run with no kill and no workers: every run below, whatever its
    workers, persistent or not, killed and resumed or not, must end with these weights and
    this history.csv (augmentation depends only on (seed, epoch, sample))."""
    work = tmp_path_factory.mktemp("exact_ref") / "ref"
    ref = _run(script, work, 0)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return work


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("workers,persistent", [(0, True), (2, True), (2, False)])
def test_sigkill_mid_epoch_with_random_augmentation_resumes_exactly(tmp_path, script, workers, persistent,
                                                                    uninterrupted):
    ref = uninterrupted
    killed = _run(script, tmp_path / "run", workers, persistent, kill=(1, 3))
    assert killed.returncode == -signal.SIGKILL
    state = torch.load(tmp_path / "run" / "model" / "last.pth", weights_only=True)
    assert (state["epoch"], state["phase"], state["batch"]) == (1, "train", 4)
    resumed = _run(script, tmp_path / "run", workers, persistent, resume="auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert weight_diff(_final(ref), _final(tmp_path / "run")) < 1e-6
    assert _history(tmp_path / "run") == _history(ref)   # the resumed epoch's train/loss too


@pytest.mark.distributed
@pytest.mark.slow
def test_augmentation_depends_on_the_sample_not_on_the_workers(tmp_path, script, uninterrupted):
    run = _run(script, tmp_path / "w2", 2)
    assert run.returncode == 0, run.stderr[-2000:]
    assert weight_diff(_final(uninterrupted), _final(tmp_path / "w2")) < 1e-6


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_inside_an_accumulation_window_resumes_exactly(tmp_path, script):
    ref = _run(script, tmp_path / "ref", accumulate=3)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _run(script, tmp_path / "run", accumulate=3, kill=(1, 4))   # window of steps 3, 4, 5
    assert killed.returncode == -signal.SIGKILL
    state = torch.load(tmp_path / "run" / "model" / "last.pth", weights_only=True)
    assert (state["epoch"], state["batch"]) == (1, 3)   # saved at the window's end only
    resumed = _run(script, tmp_path / "run", accumulate=3, resume="auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert weight_diff(_final(tmp_path / "ref"), _final(tmp_path / "run")) < 1e-6
    assert _history(tmp_path / "run") == _history(tmp_path / "ref")


# ----------------------------------------------------------------------------- clear errors
class DictData(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        x, y = blobs(32, 4, seed=0)[i]
        return {"image": x, "label": y}


class DictTrainer(ToyTrainer):
    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(DictData(), cfg.batch_size, 0, phase="train")


def test_a_dict_batch_with_the_default_run_step_says_what_to_do():
    with pytest.raises(TypeError) as err:
        DictTrainer(toy_cfg(num_epochs=1)).run()
    assert "run_step" in str(err.value) and "'image'" in str(err.value) and "(inputs, targets)" in str(err.value)


def test_an_optimizer_of_other_parameters_is_refused_at_run():
    class Detached(ToyTrainer):
        def build_optimizer(self, cfg, **kwargs):
            return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)

    with pytest.raises(RuntimeError, match="none of the model's parameters"):
        Detached(toy_cfg(num_epochs=1)).run()
