"""The run folder never loses work: reruns into a used folder, damaged checkpoints, two
ModelCheckpoints in one folder, changed configs on resume, non-finite state, callback state
keys, on_train_end on every path."""
import glob
import hashlib
import logging
import os

import pytest
import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.runtime.errors import UsageError

from conftest import Recorder, StopAt, TinyNet, ToyTrainer, toy_cfg, weight_diff


class Scripted(Callback):
    """Writes ``logs[key] = values[epoch]`` per key at each epoch end and keeps each epoch's weights."""

    def __init__(self, **series):
        super().__init__()
        self.series = series
        self.weights = {}

    def on_epoch_end(self, epoch, logs=None):
        for key, values in self.series.items():
            logs[key] = values[epoch]
        self.weights[epoch] = {k: v.clone() for k, v in self.trainer.unwrapped_model.state_dict().items()}


def digests(folder):
    out = {}
    for path in sorted(glob.glob(os.path.join(str(folder), "**", "*"), recursive=True)):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[os.path.relpath(path, str(folder))] = hashlib.sha256(f.read()).hexdigest()
    return out


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def checkpointed(work, **kw):
    kw.setdefault("indicator", "loss")
    kw.setdefault("async_save", False)
    return ModelCheckpoint(model_dir=os.path.join(str(work), "model"), **kw)


def run(work, epochs=3, callbacks=None, **cfg):
    t = ToyTrainer(toy_cfg(num_epochs=epochs, n_train=64, n_test=16, work_dir=str(work), **cfg),
                   callbacks=callbacks if callbacks is not None else [LossesRecorder(), checkpointed(work)])
    t.run()
    return t


# ----------------------------------------------------------------------------- item 1: reruns
def test_a_second_run_into_a_used_work_dir_is_refused_and_keeps_the_first(tmp_path):
    work = tmp_path / "work"
    run(work)
    before = digests(work)
    assert any(name.startswith(os.path.join("model", "best_model_")) for name in before)
    with pytest.raises(FileExistsError) as err:
        run(work, lr=0.05)              # another run, not a resume
    message = str(err.value)
    assert str(work) in message and "resume" in message and "overwrite" in message
    assert digests(work) == before      # not one byte of the first run changed


def test_a_second_run_into_a_used_checkpoint_folder_outside_work_dir_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    run("", callbacks=[LossesRecorder(), checkpointed(folder)])
    before = digests(folder)
    with pytest.raises(FileExistsError, match="overwrite"):
        run("", callbacks=[LossesRecorder(), checkpointed(folder)], lr=0.05)
    assert digests(folder) == before


def test_overwrite_moves_the_old_run_aside_and_starts_a_new_one(tmp_path):
    work = tmp_path / "work"
    run(work)
    before = digests(work)
    t = run(work, lr=0.05, overwrite=True)
    moved = glob.glob(str(tmp_path / "work.old-*"))
    assert len(moved) == 1 and digests(moved[0]) == before      # the old run, whole, beside
    assert t.start_epoch == 0 and os.path.isfile(work / "model" / "last.pth")
    assert load(str(work / "model" / "last.pth"))["config"]["lr"] == 0.05


def test_overwrite_after_the_script_opened_its_log_file_writes_the_new_run_into_the_new_folder(tmp_path):
    """A script that opens work_dir/log/train.log before it builds the trainer: the open file
    moved aside with the old run, and the new run's whole log was appended to the old run's."""
    from basetrainer.utils import log

    lib = logging.getLogger("basetrainer")
    saved = (list(lib.handlers), lib.propagate, lib.level)
    work = tmp_path / "work"
    logfile = str(work / "log" / "train.log")
    try:
        log.set_logger(logfile=logfile).info("the old run's line")
        run(work)
        logger = log.set_logger(logfile=logfile)   # the new script, before its trainer
        run(work, overwrite=True)
        logger.info("the new run's line")
        (moved,) = glob.glob(str(tmp_path / "work.old-*"))
        with open(os.path.join(moved, "log", "train.log")) as f:
            old = f.read()
        with open(logfile) as f:
            new = f.read()
        assert "the old run's line" in old and "the new run's line" not in old
        assert "the new run's line" in new and "the old run's line" not in new
        assert "moved the earlier run" in new      # the trainer's own lines from the move on
    finally:
        for handler in lib.handlers:
            if handler not in saved[0]:
                handler.close()
        lib.handlers, lib.propagate, lib.level = saved


# ----------------------------------------------------------------------------- item 2: damaged last.pth
def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def test_resume_auto_falls_back_to_the_previous_checkpoint_and_says_so(tmp_path, caplog):
    work = tmp_path / "work"
    reference = run(tmp_path / "ref")
    run(work)
    _truncate(work / "model" / "last.pth")
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        t = run(work, resume="auto")
    assert t.start_epoch == 2           # from the previous checkpoint (epoch 1), not from scratch
    assert "last.pth" in caplog.text
    assert weight_diff(t.unwrapped_model.state_dict(), reference.unwrapped_model.state_dict()) <= 1e-6
    best = glob.glob(str(work / "model" / "best_model_*.pth"))
    ref_best = glob.glob(str(tmp_path / "ref" / "model" / "best_model_*.pth"))
    assert [os.path.basename(p) for p in best] == [os.path.basename(p) for p in ref_best]


def test_resume_auto_with_nothing_loadable_stops_naming_the_damaged_file(tmp_path):
    work = tmp_path / "work"
    run(work)
    for path in glob.glob(str(work / "model" / "last*.pth")):
        _truncate(path)
    before = digests(work)
    with pytest.raises((ValueError, RuntimeError)) as err:
        run(work, resume="auto")
    assert "last.pth" in str(err.value)
    assert digests(work) == before      # nothing trained from scratch over the old run


# ----------------------------------------------------------------------------- item 6: on_train_end
class _FailsAtEnd(Callback):
    def on_train_end(self, logs=None):
        raise OSError("disk full while writing the last checkpoint")


def test_every_on_train_end_runs_and_the_first_error_is_raised_after(tmp_path, recorder):
    t = ToyTrainer(toy_cfg(num_epochs=1), callbacks=[_FailsAtEnd(), recorder])
    with pytest.raises(OSError, match="disk full"):
        t.run()
    assert recorder.events[-1] == ("on_train_end",)


# ----------------------------------------------------------------------------- item 9: two checkpoints
def test_two_model_checkpoints_in_one_folder_keep_their_own_best_files(tmp_path):
    scripted = Scripted(**{"test/loss": [0.9, 0.5, 0.7, 0.6], "test/Accuracy": [0.2, 0.3, 0.9, 0.4]})
    by_loss, by_acc = checkpointed(tmp_path, indicator="loss"), checkpointed(tmp_path, indicator="Accuracy")
    t = ToyTrainer(toy_cfg(num_epochs=4, n_train=64, n_test=16), callbacks=[scripted, by_loss, by_acc])
    t.run()
    assert os.path.isfile(by_loss.best_file) and os.path.isfile(by_acc.best_file)
    assert by_loss.best_epoch == 1 and by_acc.best_epoch == 2
    assert weight_diff(load(by_loss.best_file), scripted.weights[1]) == 0.0
    assert weight_diff(load(by_acc.best_file), scripted.weights[2]) == 0.0
    assert len(glob.glob(str(tmp_path / "model" / "best_model*.pth"))) == 2


# ----------------------------------------------------------------------------- item 10: changed config
def test_changed_lr_on_resume_is_reported_and_used(tmp_path, caplog):
    work = tmp_path / "work"
    run(work, epochs=2, lr=0.1)
    recorder = Recorder()
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        t = run(work, epochs=3, lr=0.01, resume="auto", callbacks=[LossesRecorder(), checkpointed(work), recorder])
    assert t.start_epoch == 2
    assert set(recorder.lrs) == {0.01}                          # the new value is used
    changed = [r.getMessage() for r in caplog.records if "the config differs" in r.getMessage()]
    assert len(changed) == 1, caplog.text          # one warning, each changed key as old -> new
    assert "\n  lr: 0.1 -> 0.01" in changed[0] and "\n  num_epochs: 2 -> 3" in changed[0], changed[0]


@pytest.mark.parametrize("key,value", [("seed", 7), ("net_type", "resnet50"), ("input_size", [64, 64])])
def test_resume_with_another_model_data_or_seed_is_refused(tmp_path, key, value):
    work = tmp_path / "work"
    run(work, epochs=2)
    before = digests(work)
    with pytest.raises(ValueError, match=key):
        run(work, epochs=3, resume="auto", **{key: value})
    assert digests(work) == before


def test_changed_batch_size_on_resume_is_reported(tmp_path, caplog):
    work = tmp_path / "work"
    run(work, epochs=2, batch_size=16)
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        run(work, epochs=3, batch_size=32, resume="auto")
    assert "batch_size" in caplog.text and "16" in caplog.text and "32" in caplog.text


@pytest.mark.parametrize("key,value", [("batch_size", 32), ("accumulate_steps", 3)])
def test_a_mid_epoch_resume_refuses_a_change_of_the_epochs_layout(tmp_path, key, value):
    # a mid-epoch position counts batches, and accumulation windows are laid out from the epoch's
    # first batch: accumulate_steps 2 -> 3 once gave the first window after the resume 2/3 of its gradient
    work = tmp_path / "work"
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        run(work, epochs=2, batch_size=8, accumulate_steps=2,
            callbacks=[LossesRecorder(), checkpointed(work, save_freq_steps=2), StopAt(1, 5, event="batch_begin")])
    assert load(str(work / "model" / "last.pth"))["epoch_complete"] is False
    before = digests(work)
    with pytest.raises(ValueError, match=rf"{key}: \d+ -> {value}"):
        run(work, epochs=2, resume="auto", **{"batch_size": 8, "accumulate_steps": 2, key: value})
    assert digests(work) == before
    run(work, epochs=2, batch_size=8, accumulate_steps=2, resume="auto")     # the same layout goes on


# ----------------------------------------------------------------------------- item 11: non-finite state
class _PoisonAt(Callback):
    """Sets every weight to NaN before step ``batch`` of ``epoch``."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_batch_begin(self, batch, logs=None):
        if (self.trainer.epoch, batch) == self.at:
            with torch.no_grad():
                for p in self.trainer.unwrapped_model.parameters():
                    p.fill_(float("nan"))


def test_a_non_finite_step_never_reaches_last_pth(tmp_path):
    work = tmp_path / "work"
    callbacks = [LossesRecorder(), _PoisonAt(1, 1), checkpointed(work, save_freq_steps=1)]
    t = ToyTrainer(toy_cfg(num_epochs=3, n_train=64, work_dir=str(work), log_freq=100), callbacks=callbacks)
    with pytest.raises(FloatingPointError):
        t.run()
    for path in glob.glob(str(work / "model" / "*.pth")):
        state = load(path)
        weights = state.get("model", state)
        assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()), path


def test_a_non_finite_figure_is_never_best(tmp_path):
    scripted = Scripted(**{"test/loss": [0.5, float("-inf"), float("nan"), 0.4]})
    ckpt = checkpointed(tmp_path)
    ToyTrainer(toy_cfg(num_epochs=4, n_train=32, n_test=16), callbacks=[scripted, ckpt]).run()
    assert ckpt.best_epoch == 3 and ckpt.best == 0.4


# ----------------------------------------------------------------------------- item 12: state keys
def test_callback_state_survives_a_callback_inserted_before_the_resume(tmp_path):
    work = tmp_path / "work"
    values = {"test/metric": [0.5, 0.3, 0.9, 0.8]}
    run(work, epochs=2, callbacks=[LossesRecorder(), Scripted(**values),
                                   checkpointed(work, indicator="test/metric", mode="min")])
    ckpt = checkpointed(work, indicator="test/metric", mode="min")
    run(work, epochs=4, resume="auto", callbacks=[Recorder(), LossesRecorder(), Scripted(**values), ckpt])
    assert (ckpt.best, ckpt.best_epoch) == (0.3, 1)   # epochs 2 and 3 are worse: epoch 1 stays best
    assert [os.path.basename(p) for p in glob.glob(str(work / "model" / "best_model_*.pth"))] == \
        ["best_model_001_0.3000.pth"]


# ----------------------------------------------------------------------------- compatibility, scope
def test_a_2_0_checkpoint_with_positional_callback_keys_still_resumes(tmp_path):
    work = tmp_path / "work"
    values = {"test/metric": [0.5, 0.3, 0.9, 0.8]}
    run(work, epochs=2, callbacks=[LossesRecorder(), Scripted(**values),
                                   checkpointed(work, indicator="test/metric", mode="min")])
    last = work / "model" / "last.pth"
    state = load(str(last))
    state["callbacks"] = {"2:ModelCheckpoint": {"best": 0.3, "best_epoch": 1}}   # how 2.0 wrote them
    for key in ("phase", "run_id", "logs"):
        state.pop(key)
    torch.save(state, last)
    ckpt = checkpointed(work, indicator="test/metric", mode="min")
    t = run(work, epochs=4, resume="auto", callbacks=[LossesRecorder(), Scripted(**values), ckpt])
    assert t.start_epoch == 2 and (ckpt.best, ckpt.best_epoch) == (0.3, 1)
    assert ckpt.best_file == str(work / "model" / "best_model_001_0.3000.pth")   # found on disk


def test_saved_state_that_no_callback_takes_is_named_in_a_warning(tmp_path, caplog):
    work = tmp_path / "work"
    run(work, epochs=2, callbacks=[LossesRecorder(), checkpointed(work),
                                   ModelCheckpoint(model_dir=str(tmp_path / "other"), indicator="loss")])
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        run(work, epochs=3, resume="auto", callbacks=[LossesRecorder(), checkpointed(work)])
    assert "ModelCheckpoint:other:loss" in caplog.text


def test_resume_auto_never_takes_another_runs_checkpoint_below_work_dir(tmp_path):
    other = tmp_path / "other"
    run(other, epochs=2)
    work = tmp_path / "work"
    (work / "old").mkdir(parents=True)
    os.rename(other, work / "old" / "run")          # another run's files, deeper in this work_dir
    before = digests(work / "old")
    t = run(work, epochs=2, resume="auto", callbacks=[LossesRecorder(), checkpointed(work)])
    assert t.start_epoch == 0                         # nothing of this run to resume: from scratch
    assert digests(work / "old") == before


def test_overwrite_never_moves_the_current_folder(tmp_path, monkeypatch):
    work = tmp_path / "work"
    run(work)
    monkeypatch.chdir(work)
    with pytest.raises(ValueError, match="current folder"):
        run(".", overwrite=True)
    assert os.path.isfile(work / "model" / "last.pth")


def _refused_rank(rank, work):
    try:
        run(work, epochs=1, distributed=True)
    except FileExistsError as e:
        return "FileExistsError: " + str(e)[:40]
    return "trained"


@pytest.mark.distributed
def test_every_rank_is_refused_together(tmp_path):
    from conftest import run_distributed

    work = tmp_path / "work"
    run(work, epochs=1)
    results = run_distributed(_refused_rank, 2, tmp_path, str(work), timeout=120)
    assert results[0] == results[1] and results[0].startswith("FileExistsError")


# ----------------------------------------------------------------------------- found by a hostile review
def test_resume_from_another_runs_checkpoint_never_writes_over_this_folders_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run(a, epochs=2)
    run(b, epochs=2, lr=0.05)
    before = digests(b)
    with pytest.raises(FileExistsError, match="another run"):
        run(b, epochs=4, resume=str(a / "model" / "last.pth"))
    assert digests(b) == before
    t = run(b, epochs=4, resume=str(a / "model" / "last.pth"), overwrite=True)   # B moved aside first
    assert t.start_epoch == 2
    assert digests(glob.glob(str(tmp_path / "b.old-*"))[0]) == before


def test_a_fallback_to_last_prev_keeps_it_until_a_good_last_pth_is_written(tmp_path):
    work = tmp_path / "work"
    run(work, epochs=2)
    _truncate(work / "model" / "last.pth")
    seen = {}

    class Look(Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:   # after the first save of the resumed run
                seen["prev"] = load(str(work / "model" / "last.prev.pth"))["epoch"]

    run(work, epochs=3, resume="auto", callbacks=[LossesRecorder(), checkpointed(work), Look()])
    assert seen["prev"] == 0        # the good checkpoint, not the damaged last.pth rotated over it
    assert os.path.exists(work / "model" / "last.pth.damaged")


@pytest.mark.parametrize("again", [[0.5, 0.4, 0.45], [0.5, 0.4, 0.3]])
def test_a_fallback_sets_aside_the_files_the_damaged_save_wrote(tmp_path, caplog, again):
    work = tmp_path / "work"
    run(work, epochs=3, callbacks=[Scripted(**{"test/loss": [0.5, 0.4, 0.3]}), checkpointed(work)])
    newest = glob.glob(str(work / "model" / "best_model_002_*.pth"))
    assert len(newest) == 1 and not glob.glob(str(work / "model" / "best_model_001_*.pth"))
    name = os.path.basename(newest[0])
    original = digests(work / "model")[name]
    _truncate(work / "model" / "last.pth")      # resume falls back to last.prev.pth (epoch 1, best: epoch 1)
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        # a changed lr (allowed on resume): epoch 2 trained again gives other weights, and with the
        # same figure the same file name, which once overwrote the damaged save's best file
        run(work, epochs=4, resume="auto", lr=0.05,
            callbacks=[Scripted(**{"test/loss": again + [0.1]}), checkpointed(work)])
    warning = [r.getMessage() for r in caplog.records if "best weights so far" in r.getMessage()]
    assert len(warning) == 1
    assert "best_model_001_0.4000.pth" in warning[0] and "last.prev.pth" in warning[0]
    assert f"{name}.kept" in warning[0]
    files = digests(work / "model")
    assert files[f"{name}.kept"] == original     # set aside whole: not overwritten, not deleted
    assert [f for f in files if f.startswith("best_model_") and f.endswith(".pth")] == ["best_model_003_0.1000.pth"]


def test_a_second_damaged_last_pth_keeps_the_first_one_aside(tmp_path):
    work = tmp_path / "work"
    run(work, epochs=2)
    _truncate(work / "model" / "last.pth")
    first = digests(work / "model")["last.pth"]
    run(work, epochs=3, resume="auto")
    _truncate(work / "model" / "last.pth")
    second = digests(work / "model")["last.pth"]
    run(work, epochs=4, resume="auto")
    files = digests(work / "model")
    assert files["last.pth.damaged"] == first and files["last.pth.damaged.2"] == second


def test_a_complete_last_pth_left_in_a_temp_file_is_recovered(tmp_path, caplog):
    import socket
    import subprocess

    work = tmp_path / "work"
    run(work, epochs=2)
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.replace(work / "model" / "last.pth",
               work / "model" / f".last.pth.tmp-{socket.gethostname()}-{dead.pid}")   # killed between renames
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        t = run(work, epochs=3, resume="auto")
    assert t.start_epoch == 2 and "recovered" in caplog.text


def test_two_model_checkpoints_of_one_indicator_in_one_folder_keep_their_own_models(tmp_path):
    scripted = Scripted(**{"test/Accuracy": [0.2, 0.3, 0.9]})
    other = TinyNet(4)
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(0.5)
    mine, theirs = checkpointed(tmp_path, indicator="Accuracy"), checkpointed(tmp_path, indicator="Accuracy",
                                                                             model=other)
    ToyTrainer(toy_cfg(num_epochs=3, n_train=32, n_test=16), callbacks=[scripted, mine, theirs]).run()
    assert mine.best_file != theirs.best_file
    assert weight_diff(load(mine.best_file), scripted.weights[2]) == 0.0
    assert weight_diff(load(theirs.best_file), other.state_dict()) == 0.0


def test_a_run_early_stopping_ended_stays_ended_on_resume(tmp_path):
    from basetrainer.callbacks.early_stopping import EarlyStopping

    work = tmp_path / "work"
    callbacks = [Scripted(**{"test/loss": [0.5, 0.6, 0.7, 0.1, 0.1, 0.1]}), checkpointed(work),
                 EarlyStopping("loss", patience=1)]
    first = run(work, epochs=6, callbacks=callbacks)
    assert first.epoch == 1
    again = run(work, epochs=6, resume="auto", callbacks=[Scripted(**{"test/loss": [0.5] * 6}), checkpointed(work),
                                                         EarlyStopping("loss", patience=1)])
    assert len(again.history) == 0
    assert weight_diff(again.unwrapped_model.state_dict(), first.unwrapped_model.state_dict()) == 0.0


def test_run_again_on_one_trainer_goes_on_and_keeps_the_first_runs_files(tmp_path):
    from basetrainer.callbacks.log_history import LogHistory

    reference = run(tmp_path / "ref", epochs=4)
    work = tmp_path / "work"
    t = ToyTrainer(toy_cfg(num_epochs=2, n_train=64, n_test=16, work_dir=str(work)),
                   callbacks=[LossesRecorder(), checkpointed(work), LogHistory(log_dir=str(work / "log"))])
    t.run()
    t.num_epochs = 4
    t.run()
    with open(work / "log" / "history.csv") as f:
        assert [line.split(",")[0] for line in f.read().splitlines()[1:]] == ["0", "1", "2", "3"]
    assert load(str(work / "model" / "last.pth"))["epoch"] == 3
    assert weight_diff(t.unwrapped_model.state_dict(), reference.unwrapped_model.state_dict()) <= 1e-6


class _Crash(Callback):
    def on_batch_end(self, batch, logs=None):
        raise RuntimeError("crashed in epoch 0")


def test_a_run_that_crashed_before_its_first_checkpoint_still_counts_as_a_run(tmp_path):
    from basetrainer.callbacks.log_history import LogHistory

    work = tmp_path / "work"
    with pytest.raises(RuntimeError, match="crashed"):
        run(work, callbacks=[LossesRecorder(), checkpointed(work), LogHistory(log_dir=str(work / "log")), _Crash()])
    with pytest.raises(FileExistsError):      # refused when the trainer is built, before a script writes
        ToyTrainer(toy_cfg(num_epochs=1, work_dir=str(work)))
    run(work, epochs=1, overwrite=True)
    assert len(glob.glob(str(tmp_path / "work.old-*"))) == 1


def test_a_checkpoint_folder_added_in_front_does_not_lose_the_run(tmp_path):
    work = tmp_path / "work"
    run(work, epochs=2)
    t = run(work, epochs=3, resume="auto",
            callbacks=[ModelCheckpoint(model_dir=str(tmp_path / "extra"), indicator="loss", async_save=False),
                       LossesRecorder(), checkpointed(work)])
    assert t.start_epoch == 2 and load(str(work / "model" / "last.pth"))["epoch"] == 2


def test_stale_temp_files_in_work_dir_are_removed_at_start(tmp_path):
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    work = tmp_path / "work"
    work.mkdir()
    stale = work / f".setup_config.yaml.tmp-{socket.gethostname()}-{dead.pid}"
    stale.write_text("half a file")
    ToyTrainer(toy_cfg(num_epochs=1, work_dir=str(work)))
    assert not stale.exists()


def test_resume_says_when_nothing_is_left_to_train_and_ignores_a_trailing_slash(tmp_path, caplog):
    work = tmp_path / "work"
    run(work, epochs=2)
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        t = run(str(work) + "/", epochs=2, resume="auto")
    assert len(t.history) == 0 and "nothing left to train" in caplog.text
    assert "work_dir" not in caplog.text


def test_resume_of_a_finished_run_says_so_in_one_line(tmp_path, caplog):
    from basetrainer.callbacks.log_history import LogHistory

    work = tmp_path / "work"

    def callbacks():
        return [LossesRecorder(), LogHistory(log_dir=str(work / "log"), log_freq=2), checkpointed(work)]

    first = run(work, epochs=2, callbacks=callbacks())
    with caplog.at_level(logging.INFO, logger="basetrainer"):
        t = run(work, epochs=2, resume="auto", callbacks=callbacks())
    said = [r.getMessage() for r in caplog.records if r.name.startswith("basetrainer")]
    # before: "resumed from ... continuing at epoch 2 (step 8)", "nothing left to train: ...", and
    # "resumed at epoch 2, step 0: lines above about later steps came from the interrupted run ..."
    assert said == [f"the run in {work} finished all 2 epochs (last.pth): nothing left to train; raise num_epochs "
                    f"to train on"], said
    assert len(t.history) == 0 and t.logs["train/loss"] == first.history.last["train/loss"]   # the run's figures


def test_a_read_only_run_folder_is_an_error_before_training(tmp_path, monkeypatch):
    from basetrainer.engine import resume

    work = tmp_path / "work"
    run(work, epochs=1)
    real = os.access
    folder = os.path.join(str(work), "model")   # as if mounted read-only (root could write to a chmod 555 folder)
    monkeypatch.setattr(resume.os, "access", lambda path, mode: False if str(path) == folder else real(path, mode))
    seen = []

    class Trained(Callback):
        def on_batch_begin(self, batch, logs=None):
            seen.append(batch)

    with pytest.raises(PermissionError, match="model"):
        run(work, epochs=2, resume="auto", callbacks=[LossesRecorder(), checkpointed(work), Trained()])
    assert seen == []       # refused before a step was trained


def test_a_run_without_checkpoints_leaves_no_file_and_runs_again(tmp_path, monkeypatch):
    from basetrainer.utils.setup_config import Config

    monkeypatch.chdir(tmp_path)
    for _ in range(2):   # the default work_dir, no ModelCheckpoint: nothing to protect, nothing written
        ToyTrainer(Config(num_epochs=1, progress=False, gpu_id=[])).run()
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- a run still training
@pytest.mark.distributed
@pytest.mark.parametrize("how", [dict(resume="auto"), dict(overwrite=True), dict(overwrite=True, resume="auto")],
                         ids=["resume_auto", "overwrite", "overwrite_resume_auto"])
def test_a_run_still_training_elsewhere_is_never_joined_nor_moved(tmp_path, how):
    import subprocess
    import sys
    import textwrap
    import time

    from basetrainer.runtime import run_folder

    work = tmp_path / "work"
    go = tmp_path / "go"
    script = tmp_path / "a.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import ToyTrainer, toy_cfg
        from basetrainer.callbacks.callbacks import Callback
        from basetrainer.callbacks.losses_recorder import LossesRecorder
        from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

        class Hold(Callback):   # run A trains on until the test lets it go
            def on_epoch_begin(self, epoch, logs=None):
                while epoch == 1 and not os.path.exists({str(go)!r}):
                    time.sleep(0.05)

        t = ToyTrainer(toy_cfg(num_epochs=2, n_train=64, n_test=16, work_dir={str(work)!r}),
                       callbacks=[LossesRecorder(), Hold(),
                                  ModelCheckpoint(model_dir={str(work / "model")!r}, indicator="loss", async_save=False)])
        t.run()
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (work / "model" / "last.pth").exists():    # A saved epoch 0 and waits
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.05)
        before = digests(work)
        with pytest.raises(RuntimeError) as err:   # once: accepted, and the two runs mixed their files
            run(work, epochs=2, lr=0.05, **how)     # (overwrite moved A's live folder aside first)
        assert f"process {proc.pid}" in str(err.value) and "still training" in str(err.value)
        assert isinstance(err.value, UsageError)   # a command prints it as one line, exit 2
        # refused when the trainer is made, before a script writes its config or log into the folder
        # (the example's constructor overwrote the live run's setup_config.yaml: hostile pass)
        with pytest.raises(UsageError, match="still training"):
            ToyTrainer(toy_cfg(num_epochs=2, n_train=64, n_test=16, work_dir=str(work), **how))
        assert digests(work) == before
        assert sorted(os.listdir(tmp_path)) == ["a.py", "work"]   # nothing moved aside
        go.touch()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert run_folder.read_marker(str(work / "model"))["ended"]
    t = run(work, epochs=3, resume="auto")                   # A has ended: its run goes on here
    assert t.start_epoch == 2
