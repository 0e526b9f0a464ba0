"""The loop (engine/engine.py + engine/trainer.py): event order, sampler epochs, losses of every
shape, non-finite losses, exceptions, History, and weights equal to hand-written PyTorch loops."""
import os
import sys
from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

import basetrainer
from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.multi_losses_recorder import MultiLossesRecorder
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from conftest import Recorder, TinyNet, ToyTrainer, blobs, toy_cfg, weight_diff


# ----------------------------------------------------------------------------- helpers
def expected_events(epochs: int, train_steps: int, test_steps: int) -> List[tuple]:
    """The event list of the Callback docstring, in the Recorder's format."""
    events: List[tuple] = [("on_train_begin",)]
    for e in range(epochs):
        events.append(("on_epoch_begin", e))
        for b in range(train_steps):
            events += [("on_batch_prepare", e, b), ("on_batch_begin", b), ("on_train_summary", e, b),
                       ("on_batch_end", b)]
        events.append(("on_test_begin",))
        events += [("on_test_summary", e, b) for b in range(test_steps)]
        events += [("on_test_end",), ("on_epoch_end", e)]
    events.append(("on_train_end",))
    return events


def sampler_order(n: int, epoch: int, seed: int = 0, shuffle: bool = True) -> List[int]:
    """The order a one-replica DistributedSampler(seed) gives at ``epoch``."""
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def hand_train(n_train: int, batch: int, epochs: int, lr: float, momentum: float, seed: int = 0,
               shuffle: bool = True, clip: Optional[float] = None) -> nn.Module:
    """Plain PyTorch: TinyNet on blobs, SGD, cross-entropy, the sampler's (seed, epoch) order."""
    ds = blobs(n_train, 4, seed=0)
    x_all, y_all = ds.tensors
    torch.manual_seed(seed)
    model = TinyNet(4)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for epoch in range(epochs):
        order = sampler_order(n_train, epoch, seed, shuffle)
        for s in range(0, n_train, batch):
            idx = order[s:s + batch]
            loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
            opt.zero_grad()
            loss.backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return model


# ----------------------------------------------------------------------------- event order
def test_event_order_with_test_loader(recorder):
    # 40 train samples / batch 16 -> 3 steps; 20 test samples -> 2 test batches (16 + 4)
    t = ToyTrainer(toy_cfg(n_train=40, n_test=20, num_epochs=2), callbacks=[recorder])
    t.run()
    assert recorder.events == expected_events(epochs=2, train_steps=3, test_steps=2)


def test_event_order_without_test_loader(recorder):
    t = ToyTrainer(toy_cfg(n_train=32, n_test=0, num_epochs=2), callbacks=[recorder])
    assert t.test_loader is None
    t.run()
    assert recorder.events == expected_events(epochs=2, train_steps=2, test_steps=0)
    assert [e for e in recorder.events if e[0] == "on_test_summary"] == []
    assert [e[0] for e in recorder.events].count("on_test_begin") == 2
    assert [e[0] for e in recorder.events].count("on_test_end") == 2


def test_callbacks_called_in_list_order():
    calls: List[str] = []

    class Named(Callback):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def on_epoch_end(self, epoch, logs=None):
            calls.append(f"{self.name}{epoch}")

        def on_batch_begin(self, batch, logs=None):
            calls.append(f"{self.name}b{batch}")

    ToyTrainer(toy_cfg(n_train=16, num_epochs=2), callbacks=[Named("A"), Named("B")]).run()
    assert calls == ["Ab0", "Bb0", "A0", "B0", "Ab0", "Bb0", "A1", "B1"]


# ----------------------------------------------------------------------------- sampler epochs
class SeenData(Callback):
    """Records the sampler's epoch at on_epoch_begin and the inputs of every train step."""

    def __init__(self) -> None:
        super().__init__()
        self.sampler_epochs: List[int] = []
        self.inputs: Dict[int, List[torch.Tensor]] = {}

    def on_epoch_begin(self, epoch, logs=None):
        self.sampler_epochs.append(self.trainer.train_loader.batch_sampler.epoch)
        self.inputs[epoch] = []

    def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self.inputs[epoch].append(inputs[0].clone())


def test_set_epoch_every_epoch_gives_distributed_sampler_order(monkeypatch):
    from basetrainer.dataloader.sampler import GlobalBatchSampler

    calls: List[int] = []
    original = GlobalBatchSampler.set_epoch

    def spy(self, epoch):
        calls.append(epoch)
        original(self, epoch)

    monkeypatch.setattr(GlobalBatchSampler, "set_epoch", spy)
    seen = SeenData()
    t = ToyTrainer(toy_cfg(n_train=48, num_epochs=3, seed=7), callbacks=[seen])
    t.run()
    assert calls == [0, 1, 2]
    assert seen.sampler_epochs == [0, 1, 2]
    x_all = blobs(48, 4, seed=0).tensors[0]
    orders = [sampler_order(48, e, seed=7) for e in range(3)]
    for e in range(3):
        assert torch.equal(torch.cat(seen.inputs[e]), x_all[orders[e]])
    assert orders[0] != orders[1] and orders[1] != orders[2]
    assert sorted(orders[0]) == list(range(48))


# ----------------------------------------------------------------------------- losses of every shape
class TwoLossTrainer(ToyTrainer):
    """run_step returns two losses, as a tuple or as a dict."""

    as_dict = False

    def run_step(self, inputs):
        x, y = inputs
        out = self.model(x)
        ce = F.cross_entropy(out, y)
        reg = 0.1 * (out ** 2).mean()
        return out, ({"ce": ce, "reg": reg} if self.as_dict else (ce, reg))


@pytest.mark.parametrize("as_dict", [False, True])
def test_run_step_tuple_and_dict_losses_backpropagate_the_sum(as_dict):
    cfg = toy_cfg(n_train=16, batch_size=16, num_epochs=1, momentum=0.0, shuffle=False)
    TwoLossTrainer.as_dict = as_dict
    try:
        t = TwoLossTrainer(cfg, callbacks=[MultiLossesRecorder()])
        history = t.run()
    finally:
        TwoLossTrainer.as_dict = False
    assert t.global_step == 1

    x, y = blobs(16, 4, seed=0).tensors

    def one_step(use_reg: bool) -> nn.Module:
        torch.manual_seed(0)
        model = TinyNet(4)
        out = model(x)
        loss = F.cross_entropy(out, y) + (0.1 * (out ** 2).mean() if use_reg else 0)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= 0.1 * g
        return model

    assert weight_diff(t.model, one_step(use_reg=True)) < 1e-6
    assert weight_diff(t.model, one_step(use_reg=False)) > 1e-5  # the second loss mattered
    row = history.last
    parts = ("train/ce", "train/reg") if as_dict else ("train/loss0", "train/loss1")
    assert row[parts[0]] + row[parts[1]] == pytest.approx(row["train/loss"], abs=1e-6)


# ----------------------------------------------------------------------------- non-finite loss
class NaNAt(nn.Module):
    """Cross-entropy that returns NaN on its ``at``-th call (0-based, train calls only here)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, out, y):
        loss = F.cross_entropy(out, y)
        if self.calls == self.at:
            loss = loss * float("nan")
        self.calls += 1
        return loss


class NaNTrainer(ToyTrainer):
    def build_criterion(self, cfg, **kwargs):
        return NaNAt(cfg.nan_at)


@pytest.mark.parametrize("log_freq,nan_at,where", [(1000, 3, "epoch 0, step 3"), (2, 3, "epoch 0, step 3"),
                                                    (1000, 7, "epoch 1, step 2")])
def test_non_finite_loss_names_epoch_and_step(recorder, log_freq, nan_at, where):
    # 80 samples / batch 16 = 5 steps per epoch; no test loader, so calls are train steps only
    t = NaNTrainer(toy_cfg(n_train=80, num_epochs=3, log_freq=log_freq, nan_at=nan_at), callbacks=[recorder])
    with pytest.raises(FloatingPointError) as info:
        t.run()
    assert where in str(info.value)
    assert "loss=nan" in str(info.value)
    assert recorder.events[-1] == ("on_train_end",)
    # nothing of a later epoch ran
    last_epoch = int(where.split()[1].rstrip(","))
    assert ("on_epoch_begin", last_epoch + 1) not in recorder.events


# ----------------------------------------------------------------------------- exceptions, stop, History
class Boom(Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise RuntimeError("boom")


class BadEnd(Callback):
    def on_train_end(self, logs=None):
        raise ValueError("on_train_end failed too")


def test_callback_exception_has_note_and_on_train_end_still_runs(recorder):
    t = ToyTrainer(toy_cfg(n_train=32, num_epochs=3), callbacks=[recorder, Boom()])
    with pytest.raises(RuntimeError, match="boom") as info:
        t.run()
    notes = getattr(info.value, "__notes__", [])
    assert any("Boom" in n and "on_epoch_end" in n for n in notes), notes
    assert recorder.events[-2:] == [("on_epoch_end", 0), ("on_train_end",)]
    assert ("on_epoch_begin", 1) not in recorder.events


def test_error_in_on_train_end_does_not_hide_the_first_error(recorder, caplog):
    # BadEnd comes first: the callbacks after it still get on_train_end (to close their files)
    t = ToyTrainer(toy_cfg(n_train=32, num_epochs=2), callbacks=[BadEnd(), Boom(), recorder])
    with pytest.raises(RuntimeError, match="boom"):
        t.run()
    assert recorder.events[-1] == ("on_train_end",)
    failed = [r for r in caplog.records if "BadEnd.on_train_end failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None   # one line: the error on its way is the one to read


def test_history_equals_logs_at_each_epoch_end(recorder):
    t = ToyTrainer(toy_cfg(n_train=40, n_test=20, num_epochs=3),
                   callbacks=[AccuracyRecorder(), LossesRecorder(), recorder])
    history = t.run()
    assert len(history) == 3 == len(recorder.epoch_logs)
    for e, (row, logs) in enumerate(zip(history.epochs, recorder.epoch_logs)):
        assert row == {"epoch": e, **logs}
        assert set(logs) == {"train/Accuracy", "train/loss", "test/Accuracy", "test/loss"}
    assert history["test/loss"] == [logs["test/loss"] for logs in recorder.epoch_logs]
    assert history.history["train/Accuracy"] == [logs["train/Accuracy"] for logs in recorder.epoch_logs]
    assert history.last == history.epochs[-1]


def test_stop_training_ends_after_that_epoch(recorder):
    class StopAt1(Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.trainer.stop_training = True

    t = ToyTrainer(toy_cfg(n_train=32, num_epochs=5), callbacks=[StopAt1(), recorder])
    history = t.run()
    assert [r["epoch"] for r in history.epochs] == [0, 1]
    assert [e[1] for e in recorder.events if e[0] == "on_epoch_end"] == [0, 1]
    assert recorder.events[-1] == ("on_train_end",)
    assert t.global_step == 4  # 2 epochs x 2 steps


def test_stop_training_set_in_on_train_begin_runs_no_epoch(recorder):
    class StopAtBegin(Callback):   # as a search's check launch ends a run before its first step
        def on_train_begin(self, logs=None):
            self.trainer.stop_training = True

    t = ToyTrainer(toy_cfg(n_train=32, num_epochs=5), callbacks=[StopAtBegin(), recorder])
    history = t.run()
    assert history.epochs == [] and t.global_step == 0
    assert recorder.events == [("on_train_begin",), ("on_train_end",)]


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_end_to_end_accuracy_and_weights_equal_hand_loop():
    cfg = toy_cfg(n_train=128, n_test=64, num_epochs=3, momentum=0.9, lr=0.1, seed=0)
    acc, losses = AccuracyRecorder(), LossesRecorder()
    t = ToyTrainer(cfg, callbacks=[acc, losses])
    history = t.run()
    assert history.last["test/Accuracy"] >= 0.95
    assert t.global_step == 3 * 8
    reference = hand_train(128, 16, 3, lr=0.1, momentum=0.9, seed=0)
    assert weight_diff(t.model, reference) < 1e-6

    # the recorded test figures are those of the final model on the test set
    x, y = blobs(64, 4, seed=1).tensors
    with torch.no_grad():
        out = reference(x)
    assert history.last["test/Accuracy"] == pytest.approx(float((out.argmax(1) == y).float().mean()), abs=1e-9)
    assert history.last["test/loss"] == pytest.approx(float(F.cross_entropy(out, y)), abs=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch():
    # 40 samples: batch 8 x 4 micro-steps -> updates over 32 then 8 samples, as batches 32 and 8
    small = ToyTrainer(toy_cfg(n_train=40, batch_size=8, accumulate_steps=4, shuffle=False, num_epochs=2,
                               momentum=0.9))
    small.run()
    big = ToyTrainer(toy_cfg(n_train=40, batch_size=32, shuffle=False, num_epochs=2, momentum=0.9))
    big.run()
    assert small.global_step == big.global_step == 4
    assert weight_diff(small.model, big.model) < 1e-6
    no_accum = ToyTrainer(toy_cfg(n_train=40, batch_size=8, shuffle=False, num_epochs=2, momentum=0.9))
    no_accum.run()
    assert weight_diff(no_accum.model, big.model) > 1e-4  # accumulation made the difference


@pytest.mark.slow
def test_clip_grad_norm_equals_hand_loop_that_clips():
    t = ToyTrainer(toy_cfg(n_train=64, num_epochs=2, momentum=0.0, clip_grad_norm=0.25))
    t.run()
    clipped = hand_train(64, 16, 2, lr=0.1, momentum=0.0, clip=0.25)
    unclipped = hand_train(64, 16, 2, lr=0.1, momentum=0.0)
    assert weight_diff(t.model, clipped) < 1e-6
    assert weight_diff(t.model, unclipped) > 1e-3  # clipping changed the result


def test_bf16_on_cpu_trains():
    dtypes = []

    class Dtype(Callback):
        def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
            dtypes.append(outputs.dtype)

    t = ToyTrainer(toy_cfg(n_train=128, n_test=64, num_epochs=3, amp="bf16"),
                   callbacks=[AccuracyRecorder(), Dtype()])
    history = t.run()
    assert set(dtypes) == {torch.bfloat16}
    assert history.last["test/Accuracy"] >= 0.9
    assert all(p.dtype == torch.float32 for p in t.model.parameters())


def test_bad_amp_and_accumulate_steps_are_clear_errors():
    t = ToyTrainer(toy_cfg(n_train=16, amp="fp8"))
    with pytest.raises(ValueError, match="amp='fp8'"):
        t.run()
    t = ToyTrainer(toy_cfg(n_train=16, amp="fp16"))
    with pytest.raises(ValueError, match="CUDA"):
        t.run()


# ----------------------------------------------------------------------------- host syncs
_SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")


def _count_host_syncs(monkeypatch) -> Dict[str, int]:
    """Count the calls of ``_SYNC_METHODS`` made from basetrainer's own code."""
    package_dir = os.path.dirname(os.path.abspath(basetrainer.__file__))
    counts = {"n": 0}

    for name in _SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(package_dir):
                counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


class SyncWindow(Callback):
    """With ``first`` at the head and ``last`` at the tail of the callbacks, records the host
    syncs made by basetrainer between the start and the end of every train step."""

    def __init__(self, counts: Dict[str, int], start: Optional["SyncWindow"] = None) -> None:
        super().__init__()
        self.counts, self.start = counts, start
        self.mark = 0
        self.per_step: List[tuple] = []

    def on_batch_prepare(self, epoch, batch, logs=None):
        if self.start is None:
            self.mark = self.counts["n"]

    def on_batch_end(self, batch, logs=None):
        if self.start is not None:
            self.per_step.append((batch, self.counts["n"] - self.start.mark))


def _sync_run(monkeypatch, n_train: int, log_freq: int):
    counts = _count_host_syncs(monkeypatch)
    first = SyncWindow(counts)
    last = SyncWindow(counts, start=first)
    t = ToyTrainer(toy_cfg(n_train=n_train, n_test=32, num_epochs=2, log_freq=log_freq),
                   callbacks=[first, AccuracyRecorder(topk=(1, 2)), LossesRecorder(), last])
    counts["n"] = 0
    history = t.run()
    total = counts["n"]
    monkeypatch.undo()
    return t, last.per_step, total, history


@pytest.mark.slow
def test_no_per_step_host_sync(monkeypatch):
    t, per_step, total_10, history = _sync_run(monkeypatch, n_train=160, log_freq=1000)   # 10 steps/epoch
    assert len(per_step) == 20
    # only the last step of each epoch is a log point: every other step makes no host sync at all
    assert [n for b, n in per_step if b != 9] == [0] * 18
    at_log = [n for b, n in per_step if b == 9]
    assert at_log[0] == at_log[1] > 0
    _, per_step_5, total_5, _ = _sync_run(monkeypatch, n_train=80, log_freq=1000)        # 5 steps/epoch
    assert [n for b, n in per_step_5 if b != 4] == [0] * 8
    # twice the steps, the same number of host syncs: none of them is per step
    assert total_10 == total_5
    assert history.last["test/Accuracy_top2"] >= history.last["test/Accuracy"]


@pytest.mark.slow
def test_host_syncs_only_at_log_points(monkeypatch):
    _, per_step, _, _ = _sync_run(monkeypatch, n_train=160, log_freq=4)
    log_points = {3, 7, 9}
    assert [n for b, n in per_step if b not in log_points] == [0] * (20 - 6)
    at_log = [n for b, n in per_step if b in log_points]
    assert len(set(at_log)) == 1 and at_log[0] > 0  # the same reads at every log point


@pytest.mark.slow
def test_bf16_on_cpu_trains_the_digits_to_the_accuracy_band():
    """amp='bf16' on the CPU, on the bundled digits (sklearn), through the whole loop."""
    sklearn = pytest.importorskip("sklearn", reason="scikit-learn (extra 'dev') holds the digits data")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data import TensorDataset

    from basetrainer.metric.accuracy_recorder import AccuracyRecorder

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)

    class DigitsTrainer(ToyTrainer):
        def build_train_loader(self, cfg, **kwargs):
            ds = TensorDataset(torch.tensor(xtr, dtype=torch.float32), torch.tensor(ytr))
            return self.build_dataloader(ds, cfg.batch_size, 0, phase="train")

        def build_test_loader(self, cfg, **kwargs):
            ds = TensorDataset(torch.tensor(xte, dtype=torch.float32), torch.tensor(yte))
            return self.build_dataloader(ds, cfg.batch_size, 0, phase="test", shuffle=False)

    acc = AccuracyRecorder()
    t = DigitsTrainer(toy_cfg(num_epochs=15, batch_size=32, lr=0.1, momentum=0.9, amp="bf16", num_classes=10),
                      callbacks=[acc], model=TinyNet(10, in_features=64, hidden=128))
    history = t.run()
    assert history.last["test/Accuracy"] >= 0.95
