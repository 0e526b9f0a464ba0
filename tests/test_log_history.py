"""LogHistory: TensorBoard events, history.csv, history.png, step lines, rank-0-only writes."""
import csv
import logging
import os
import re

import pytest

from basetrainer.callbacks.log_history import LogHistory
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from basetrainer.scheduler import build_scheduler
from conftest import ToyTrainer, toy_cfg

EPOCHS = 3
STEPS = 5  # 80 train samples / batch 16


def run_logged(log_dir, log_freq=2, is_main_process=True, logger=None):
    cfg = toy_cfg(n_train=80, n_test=24, num_epochs=EPOCHS, log_freq=1000)
    history_cb = LogHistory(log_dir=str(log_dir), log_freq=log_freq, logger=logger,
                            is_main_process=is_main_process)
    t = ToyTrainer(cfg, callbacks=[AccuracyRecorder(), LossesRecorder()])
    sched = build_scheduler.get_scheduler("multi-step", t.optimizer, lr_init=0.1, num_epochs=EPOCHS,
                                          num_steps=t.num_steps, milestones=[1, 2])
    t.callbacks += [sched, history_cb]
    return t, t.run()


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("log")
    t, history = run_logged(log_dir)
    return log_dir, t, history


def test_tensorboard_scalars_equal_history(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, t, history = logged
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/Accuracy", "test/loss", "test/Accuracy", "lr"} <= tags
    steps = EventAccumulator(os.path.join(str(log_dir), "steps"))   # step scalars: their own x axis
    steps.Reload()
    assert {"train_step/loss", "train_step/Accuracy", "train_step/lr"} <= set(steps.Tags()["scalars"])
    for tag in ("train/loss", "train/Accuracy", "test/loss", "test/Accuracy", "lr"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(range(EPOCHS))
        assert [e.value for e in events] == pytest.approx(history[tag], rel=1e-6, abs=1e-7)
    assert [e.value for e in acc.Scalars("lr")] == pytest.approx([0.1, 0.01, 0.001])
    # train_step scalars every log_freq=2 steps: x = epoch * 5 + step, steps 2 and 4 of each epoch
    assert [e.step for e in steps.Scalars("train_step/loss")] == [e * STEPS + s for e in range(EPOCHS) for s in (2, 4)]
    assert t.log_freq == 2  # LogHistory sets how often the recorders publish running figures


def test_history_csv_equals_history(logged):
    log_dir, _, history = logged
    with open(os.path.join(str(log_dir), "history.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == EPOCHS
    assert set(rows[0]) == {"epoch", "lr", "train/loss", "train/Accuracy", "test/loss", "test/Accuracy",
                            "epoch_time", "data_wait", "data_wait_mean", "data_wait_rank"}   # timings: not in History
    for row, expected in zip(rows, history.epochs):
        assert int(row["epoch"]) == expected["epoch"]
        for key, value in expected.items():
            assert float(row[key]) == value, key   # written with repr: exact round trip
        assert float(row["epoch_time"]) > 0
        assert 0 <= float(row["data_wait"]) <= 1 and row["data_wait_rank"] == "0"   # tests/test_data_stall.py


def test_history_png_written(logged):
    log_dir, _, _ = logged
    path = os.path.join(str(log_dir), "history.png")
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 5000


def test_nothing_written_when_not_main_process(tmp_path):
    log_dir = tmp_path / "log"
    _, history = run_logged(log_dir, is_main_process=False)
    assert len(history) == EPOCHS
    assert not log_dir.exists() or os.listdir(log_dir) == []


def test_step_lines_every_log_freq(tmp_path, caplog):
    logger = logging.getLogger("test_log_history.lines")
    with caplog.at_level(logging.INFO, logger=logger.name):
        run_logged(tmp_path / "log", log_freq=2, logger=logger)
    step_lines = [r.getMessage() for r in caplog.records if r.name == logger.name and " step " in r.getMessage()]
    assert len(step_lines) == EPOCHS * 2   # steps 2 and 4 of 5, each epoch
    for line in step_lines:
        assert "samples/s" in line and "ETA" in line
        assert re.search(r"ETA \d\d:\d\d:\d\d", line)
        assert "loss: " in line and "lr: " in line
    assert [re.search(r"step (\d+)/5", line).group(1) for line in step_lines] == ["2", "4"] * EPOCHS
    assert "epoch 0/3 step 2/5" in step_lines[0]
    done = [r.getMessage() for r in caplog.records if r.name == logger.name and "done" in r.getMessage()]
    assert len(done) == EPOCHS and "test/Accuracy" in done[-1]


def test_bad_log_freq():
    with pytest.raises(ValueError, match="log_freq"):
        LogHistory(log_dir="x", log_freq=0)


@pytest.mark.parametrize("count_in_checkpoint", [True, False])
def test_step_scalars_of_earlier_epochs_survive_a_resume_with_another_batch_size(tmp_path, count_in_checkpoint):
    """The x of a step scalar counts the steps really taken: a resume with a larger batch (fewer
    steps an epoch) goes on after the last one. It used to restart at epoch * (new steps an
    epoch) and purge the events from there: the step scalars of epoch 1 were deleted. A
    checkpoint without the count (2.0's) gives the trainer's global_step instead."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

    def run(batch_size, epochs, resume):
        cfg = toy_cfg(n_train=80, n_test=16, num_epochs=epochs, batch_size=batch_size,
                      work_dir=str(tmp_path), resume=resume)
        callbacks = [LossesRecorder(), ModelCheckpoint(model_dir=str(tmp_path / "model"), indicator="loss"),
                     LogHistory(log_dir=str(tmp_path / "log"), log_freq=1)]
        ToyTrainer(cfg, callbacks=callbacks).run()
        acc = EventAccumulator(str(tmp_path / "log" / "steps"))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars("train_step/loss")]

    first = run(8, 2, "")          # 10 steps an epoch: x 1..20
    assert [x for x, _ in first] == list(range(1, 21))
    if not count_in_checkpoint:
        import torch

        path = tmp_path / "model" / "last.pth"
        state = torch.load(path, weights_only=False)
        assert state["callbacks"]["LogHistory:log"].pop("step_ends") == {0: 10, 1: 20}
        torch.save(state, path)
    resumed = run(16, 3, "auto")   # epoch 2 with 5 steps: x 21..25
    assert resumed[:20] == first
    assert [x for x, _ in resumed] == list(range(1, 26))


QUIET_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import ToyTrainer, toy_cfg
from basetrainer.callbacks.log_history import LogHistory
from basetrainer.callbacks.losses_recorder import LossesRecorder

# a script that sets up no logging and passes LogHistory no logger
cfg = toy_cfg(n_train=64, num_epochs=2, log_freq=2)
ToyTrainer(cfg, callbacks=[LossesRecorder(), LogHistory(log_dir=sys.argv[1], log_freq=2)]).run()
"""


@pytest.mark.distributed
def test_progress_is_printed_without_any_logging_setup(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    script = tmp_path / "quiet.py"
    script.write_text(QUIET_SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "log")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    done = re.findall(r"INFO log_history\.py:\d+\] epoch (\d)/2 done: .*train/loss: ([\d.]+)", proc.stdout)
    assert [epoch for epoch, _ in done] == ["0", "1"], proc.stdout   # before: nothing on stdout
    with open(tmp_path / "log" / "history.csv", newline="") as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f)]
    assert [float(loss) for _, loss in done] == pytest.approx(losses, rel=1e-5)
    steps = re.findall(r"epoch \d/2 step (\d)/4 ", proc.stdout)
    assert steps == ["2", "4", "2", "4"], proc.stdout   # and a line every log_freq steps


def test_a_run_without_recorders_or_schedule_ends_without_a_png(tmp_path):
    """No figure to draw (only epoch_time and the data-stall meter): before, matplotlib raised
    "Number of columns must be a positive integer, not 0" from on_train_end."""
    log_dir = tmp_path / "log"
    t = ToyTrainer(toy_cfg(n_train=32, num_epochs=1), callbacks=[LogHistory(log_dir=str(log_dir))])
    t.run()
    assert os.path.isfile(log_dir / "history.csv") and not os.path.exists(log_dir / "history.png")
