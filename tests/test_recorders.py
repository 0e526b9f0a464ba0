"""Recorders on hand-made tensors: AccuracyRecorder, LossesRecorder, MultiLossesRecorder, and how
a bare indicator resolves to train/ or test/."""
import glob
import os
from types import SimpleNamespace

import pytest
import torch

from basetrainer.callbacks.callbacks import Callback, resolve_indicator
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.callbacks.multi_losses_recorder import MultiLossesRecorder
from basetrainer.metric.accuracy_recorder import AccuracyRecorder, ConfusionCounts
from conftest import ToyTrainer, toy_cfg


def fake_trainer(train: bool = True, test: bool = True, log: bool = False):
    """What recorders read from the trainer: the loaders and should_log."""
    return SimpleNamespace(train_loader=object() if train else None, test_loader=object() if test else None,
                           should_log=lambda batch: log, model=None)


def logits_for(preds, num_classes=3, second=None):
    """Logits whose argmax is ``preds`` (and whose second choice is ``second``)."""
    out = torch.zeros(len(preds), num_classes)
    for i, p in enumerate(preds):
        out[i, p] = 2.0
        if second is not None:
            out[i, second[i]] = 1.0
    return out


def feed_test(rec, batches, trainer=None):
    """Run one test phase of ``rec`` over ``batches`` = [(outputs, targets, losses), ...]."""
    rec.set_trainer(trainer or fake_trainer())
    logs = {}
    rec.on_epoch_begin(0, logs)
    rec.on_test_begin(logs)
    for b, (outputs, targets, losses) in enumerate(batches):
        inputs = (torch.zeros(len(targets), 2), targets)
        rec.on_test_summary(inputs, outputs, losses, 0, b, logs)
    rec.on_test_end(logs)
    return logs


def feed_train(rec, batches, trainer=None):
    """One train phase (on_epoch_begin .. on_test_begin) over ``batches``."""
    rec.set_trainer(trainer or fake_trainer(test=False))
    logs = {}
    rec.on_epoch_begin(0, logs)
    for b, (outputs, targets, losses) in enumerate(batches):
        inputs = (torch.zeros(len(targets), 2), targets)
        rec.on_train_summary(inputs, outputs, losses, 0, b, logs)
    rec.on_test_begin(logs)
    return logs


# ----------------------------------------------------------------------------- AccuracyRecorder
def test_top1_and_topk_fractions_exact():
    targets = torch.tensor([0, 1, 2, 0, 1])
    preds = [0, 2, 2, 1, 0]        # top-1 right: samples 0 and 2 -> 2/5
    second = [1, 1, 0, 0, 2]       # top-2 adds samples 1 and 3 -> 4/5
    rec = AccuracyRecorder(topk=(1, 2))
    logs = feed_test(rec, [(logits_for(preds, second=second), targets, None)])
    assert logs["test/Accuracy"] == 2 / 5
    assert logs["test/Accuracy_top2"] == 4 / 5
    assert "train/Accuracy" not in logs  # no train batch was seen


def test_topk_beyond_classes_is_all_right_and_bad_topk_is_an_error():
    rec = AccuracyRecorder(topk=(5,))
    logs = feed_test(rec, [(logits_for([1, 1, 1]), torch.tensor([0, 1, 2]), None)])
    assert logs["test/Accuracy"] == 1 / 3
    assert logs["test/Accuracy_top5"] == 1.0   # 3 classes: top-5 holds every class
    with pytest.raises(ValueError, match="topk"):
        AccuracyRecorder(topk=(0,))


def test_accuracy_is_sample_weighted_over_unequal_batches():
    # batch of 3 with 1 right, batch of 1 with 1 right: 2/4 = 0.5 (the mean of batch means is 2/3)
    rec = AccuracyRecorder()
    logs = feed_test(rec, [(logits_for([0, 0, 0]), torch.tensor([0, 1, 2]), None),
                           (logits_for([1]), torch.tensor([1]), None)])
    assert logs["test/Accuracy"] == 0.5
    train_logs = feed_train(AccuracyRecorder(), [(logits_for([0, 0, 0]), torch.tensor([0, 1, 2]), None),
                                                 (logits_for([1]), torch.tensor([1]), None)])
    assert train_logs["train/Accuracy"] == 0.5


def test_per_class_accuracy_and_confusion_matrix():
    targets = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    preds = [0, 0, 1, 1, 2, 2, 2, 0, 2]
    rec = AccuracyRecorder(target_names=["cat", "dog", "emu"])
    logs = feed_test(rec, [(logits_for(preds[:4]), targets[:4], None), (logits_for(preds[4:]), targets[4:], None)])
    expected = torch.tensor([[2, 1, 0],
                             [0, 1, 1],
                             [1, 0, 3]])
    assert torch.equal(rec.confusion_matrix, expected)
    assert rec.per_class == {"cat": 2 / 3, "dog": 1 / 2, "emu": 3 / 4}
    assert logs["test/Accuracy"] == 6 / 9
    report = rec.report()
    assert "cat" in report and "0.6667" in report and "0.7500" in report


def test_one_hot_targets_and_tuple_outputs():
    rec = AccuracyRecorder()
    one_hot = torch.eye(3)[torch.tensor([0, 1, 2, 2])]
    logs = feed_test(rec, [((logits_for([0, 1, 1, 2]), "aux"), one_hot, None)])
    assert logs["test/Accuracy"] == 3 / 4


def test_target_names_length_mismatch_is_an_error():
    rec = AccuracyRecorder(target_names=["a", "b"])
    with pytest.raises(ValueError, match="outputs 3 classes but target_names has 2"):
        feed_test(rec, [(logits_for([0, 1]), torch.tensor([0, 1]), None)])


def test_running_train_figure_published_at_log_points_only():
    rec = AccuracyRecorder()
    rec.set_trainer(fake_trainer(log=False))
    logs = {}
    rec.on_epoch_begin(0, logs)
    rec.on_train_summary((torch.zeros(2, 2), torch.tensor([0, 1])), logits_for([0, 0]), None, 0, 0, logs)
    assert "train/Accuracy" not in logs
    rec.trainer.should_log = lambda batch: True
    rec.on_train_summary((torch.zeros(2, 2), torch.tensor([0, 1])), logits_for([0, 1]), None, 0, 1, logs)
    assert logs["train/Accuracy"] == 3 / 4
    # a new epoch starts from zero
    rec.on_epoch_begin(1, logs)
    rec.on_train_summary((torch.zeros(1, 2), torch.tensor([1])), logits_for([0]), None, 1, 0, logs)
    assert logs["train/Accuracy"] == 0.0


# ----------------------------------------------------------------------------- LossesRecorder
def test_loss_is_sample_weighted_over_unequal_batches():
    # loss 1.0 over 3 samples, 3.0 over 1 sample: (3 + 3) / 4 = 1.5 (the mean of batch means is 2.0)
    batches = [(None, torch.tensor([0, 1, 2]), torch.tensor(1.0)), (None, torch.tensor([0]), torch.tensor(3.0))]
    assert feed_train(LossesRecorder(), batches)["train/loss"] == 1.5
    assert feed_test(LossesRecorder(), batches)["test/loss"] == 1.5


def test_losses_recorder_keys_use_the_indicator():
    batches = [(None, torch.tensor([0, 1]), torch.tensor(0.25))]
    logs = feed_test(LossesRecorder(indicator="ce"), batches)
    assert logs == {"test/ce": 0.25}
    logs = feed_train(LossesRecorder(indicator="ce"), batches)
    assert logs == {"train/ce": 0.25}


def test_losses_recorder_writes_only_the_total_of_a_dict():
    batches = [(None, torch.tensor([0, 1]), {"cls": torch.tensor(1.0), "box": torch.tensor(0.5)})]
    assert feed_test(LossesRecorder(), batches) == {"test/loss": 1.5}


def test_multi_losses_recorder_writes_each_part_and_the_total():
    batches = [(None, torch.tensor([0, 1, 2]), {"cls": torch.tensor(1.0), "box": torch.tensor(0.5)}),
               (None, torch.tensor([0]), {"cls": torch.tensor(2.0), "box": torch.tensor(4.5)})]
    test_logs = feed_test(MultiLossesRecorder(), batches)
    assert test_logs == {"test/cls": (3 * 1.0 + 2.0) / 4, "test/box": (3 * 0.5 + 4.5) / 4,
                         "test/loss": (3 * 1.5 + 6.5) / 4}
    train_logs = feed_train(MultiLossesRecorder(indicator="total"), batches)
    assert train_logs == {"train/cls": 1.25, "train/box": 1.5, "train/total": 2.75}
    tuple_logs = feed_test(MultiLossesRecorder(), [(None, torch.tensor([0, 1]), (torch.tensor(1.0), torch.tensor(2.0)))])
    assert tuple_logs == {"test/loss0": 1.0, "test/loss1": 2.0, "test/loss": 3.0}


def test_losses_recorder_writes_no_test_figure_without_test_loader():
    rec = LossesRecorder()
    logs = feed_train(rec, [(None, torch.tensor([0, 1]), torch.tensor(0.5))], trainer=fake_trainer(test=False))
    rec.on_test_end(logs)
    assert logs == {"train/loss": 0.5}


# ----------------------------------------------------------------------------- indicators
def test_resolve_indicator():
    with_test, without_test = fake_trainer(test=True), fake_trainer(test=False)
    assert resolve_indicator("Accuracy", with_test) == "test/Accuracy"
    assert resolve_indicator("Accuracy", without_test) == "train/Accuracy"
    assert resolve_indicator("train/loss", with_test) == "train/loss"
    assert resolve_indicator("test/loss", without_test) == "test/loss"
    assert resolve_indicator("lr", with_test) == "lr"


class KeepBest(Callback):
    """Records logs at each epoch end (placed after the recorders)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_epoch_end(self, epoch, logs=None):
        self.rows.append(dict(logs))


@pytest.mark.parametrize("n_test,phase", [(20, "test"), (0, "train")])
def test_bare_indicator_in_model_checkpoint_resolves_by_test_loader(tmp_path, n_test, phase):
    keep = KeepBest()
    ckpt = ModelCheckpoint(model_dir=str(tmp_path), indicator="loss", start_save=0)
    t = ToyTrainer(toy_cfg(n_train=32, n_test=n_test, num_epochs=3),
                   callbacks=[LossesRecorder(), AccuracyRecorder(), keep, ckpt])
    t.run()
    values = [row[f"{phase}/loss"] for row in keep.rows]
    best_epoch = min(range(3), key=lambda e: values[e])
    files = [os.path.basename(p) for p in glob.glob(os.path.join(str(tmp_path), "best_model_*.pth"))]
    assert files == [f"best_model_{best_epoch:03d}_{values[best_epoch]:.4f}.pth"]
    assert ckpt.best == values[best_epoch] and ckpt.mode == "min"


def test_missing_indicator_names_the_key_and_the_figures(tmp_path):
    t = ToyTrainer(toy_cfg(n_train=16, n_test=0, num_epochs=1),
                   callbacks=[LossesRecorder(), ModelCheckpoint(model_dir=str(tmp_path), indicator="Accuracy")])
    with pytest.raises(KeyError) as info:
        t.run()
    assert "train/Accuracy" in str(info.value) and "train/loss" in str(info.value)


def test_deferred_confusion_counts_equal_a_direct_count_over_many_batches():
    g = torch.Generator().manual_seed(0)
    counts = ConfusionCounts((1,))
    expected = torch.zeros(5, 5, dtype=torch.long)
    for step in range(600):   # more than FOLD_EVERY pending batches, read now and then
        n = 1 + step % 7
        outputs, targets = torch.randn(n, 5, generator=g), torch.randint(0, 5, (n,), generator=g)
        counts.update(outputs, targets)
        for t, p in zip(targets.tolist(), outputs.argmax(1).tolist()):
            expected[t, p] += 1
        if step in (10, 11, 400):
            assert torch.equal(counts.matrix_2d(5), expected)
        assert len(counts._pending) <= ConfusionCounts.FOLD_EVERY
    assert torch.equal(counts.matrix_2d(5), expected)
    counts.reset()
    assert counts.matrix is None


def test_confusion_matrix_goes_to_a_file_and_tensorboard_and_one_line_to_the_log(tmp_path, caplog):
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from basetrainer.callbacks.log_history import LogHistory

    accuracy = AccuracyRecorder(target_names=["ant", "bee", "cat", "dog"])
    log_dir = tmp_path / "log"
    t = ToyTrainer(toy_cfg(num_epochs=2, n_test=32),
                   callbacks=[accuracy, LogHistory(log_dir=str(log_dir), log_freq=100)])
    with caplog.at_level(logging.INFO, logger="basetrainer"):
        t.run()
    lines = [r.getMessage() for r in caplog.records if r.name == "basetrainer.metric.accuracy_recorder"]
    assert len(lines) == 2 and all("\n" not in line for line in lines)     # one line per test phase
    assert all("test Accuracy" in line and "confusion_matrix.txt" in line for line in lines)
    text = (log_dir / "confusion_matrix.txt").read_text()
    assert text == accuracy.report() + "\n" and "confusion matrix" in text and "ant" in text
    events = EventAccumulator(str(log_dir))
    events.Reload()
    assert any(tag.startswith("test/confusion_matrix") for tag in events.Tags()["tensors"])
