"""ModelCheckpoint, atomic saves, safe loads and resume (callbacks/model_checkpoint.py,
engine/checkpoint.py, utils/torch_tools.py, EngineTrainer.restore)."""
import glob
import io
import os
from typing import Dict, List

import pytest
import torch
from torch import nn

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.runtime import atomic, checkpoint
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from basetrainer.scheduler import build_scheduler
from basetrainer.utils import torch_tools
from conftest import Recorder, StopAt, TinyNet, ToyTrainer, toy_cfg, weight_diff


class Scripted(Callback):
    """Writes ``logs[key] = values[epoch]`` at each epoch end and snapshots the weights."""

    def __init__(self, key: str, values: List[float]) -> None:
        super().__init__()
        self.key, self.values = key, values
        self.weights: Dict[int, Dict[str, torch.Tensor]] = {}

    def on_epoch_end(self, epoch, logs=None):
        logs[self.key] = self.values[epoch]
        self.weights[epoch] = {k: v.clone() for k, v in self.trainer.model.state_dict().items()}


def names(folder, pattern="*.pth"):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(folder), pattern)))


def run_scripted(tmp_path, key, values, indicator, n_test=16, **ckpt_kwargs):
    script = Scripted(key, values)
    ckpt = ModelCheckpoint(model_dir=str(tmp_path / "model"), indicator=indicator, **ckpt_kwargs)
    t = ToyTrainer(toy_cfg(n_train=32, n_test=n_test, num_epochs=len(values)), callbacks=[script, ckpt])
    t.run()
    return t, script, ckpt


# ----------------------------------------------------------------------------- best / per-epoch files
def test_best_file_follows_max_accuracy(tmp_path):
    t, script, ckpt = run_scripted(tmp_path, "test/Accuracy", [0.5, 0.7, 0.6, 0.8, 0.8], "Accuracy", start_save=0)
    assert ckpt.mode == "max"
    assert names(tmp_path / "model", "best_model_*.pth") == ["best_model_003_0.8000.pth"]
    assert ckpt.best == 0.8 and ckpt.best_epoch == 3   # a tie does not replace the best
    saved = torch.load(tmp_path / "model" / "best_model_003_0.8000.pth", weights_only=True)
    assert weight_diff(saved, script.weights[3]) == 0.0
    assert names(tmp_path / "model") == ["best_model_003_0.8000.pth", "last.prev.pth", "last.pth"]


def test_best_file_follows_min_loss_inferred(tmp_path):
    t, script, ckpt = run_scripted(tmp_path, "test/loss", [1.0, 0.5, 0.7, 0.6], "loss", start_save=0)
    assert ckpt.mode == "min"
    assert names(tmp_path / "model", "best_model_*.pth") == ["best_model_001_0.5000.pth"]
    saved = torch.load(tmp_path / "model" / "best_model_001_0.5000.pth", weights_only=True)
    assert weight_diff(saved, script.weights[1]) == 0.0


def test_nan_never_becomes_best(tmp_path):
    _, _, ckpt = run_scripted(tmp_path, "test/Accuracy", [float("nan"), 0.3, float("nan")], "Accuracy",
                              start_save=0)
    assert names(tmp_path / "model", "best_model_*.pth") == ["best_model_001_0.3000.pth"]


@pytest.mark.parametrize("start_save,keep,expected", [
    (-1, 2, ["model_003_0.4000.pth", "model_004_0.5000.pth"]),
    (None, 10, [f"model_{e:03d}_0.{e + 1}000.pth" for e in range(5)]),
    (0, 10, []),
    (2, 10, ["model_002_0.3000.pth", "model_003_0.4000.pth", "model_004_0.5000.pth"]),
])
def test_per_epoch_files(tmp_path, start_save, keep, expected):
    run_scripted(tmp_path, "test/Accuracy", [0.1, 0.2, 0.3, 0.4, 0.5], "Accuracy", start_save=start_save, keep=keep)
    assert names(tmp_path / "model", "model_*.pth") == expected
    assert names(tmp_path / "model", "best_model_*.pth") == ["best_model_004_0.5000.pth"]


def test_per_epoch_file_holds_that_epochs_weights(tmp_path):
    _, script, _ = run_scripted(tmp_path, "test/Accuracy", [0.1, 0.2, 0.3], "Accuracy", start_save=1)
    saved = torch_tools.load_state_dict(str(tmp_path / "model" / "model_001_0.2000.pth"))
    assert weight_diff(saved, script.weights[1]) == 0.0


def test_bad_start_save_and_missing_folder():
    with pytest.raises(ValueError, match="start_save"):
        ModelCheckpoint(model_dir="x", start_save=-2)
    with pytest.raises(ValueError, match="model_dir"):
        ModelCheckpoint(indicator="Accuracy")


# ----------------------------------------------------------------------------- last.pth
def test_last_pth_is_weights_only_and_complete(tmp_path):
    ckpt = ModelCheckpoint(moder_dir=str(tmp_path / "model"), indicator="Accuracy", start_save=0)
    assert ckpt.moder_dir == str(tmp_path / "model")
    t = ToyTrainer(toy_cfg(n_train=48, n_test=16, num_epochs=2), callbacks=[AccuracyRecorder(), ckpt])
    t.run()
    state = torch.load(tmp_path / "model" / "last.pth", weights_only=True)
    assert {"model", "optimizer", "epoch", "global_step", "rng", "config", "callbacks"} <= set(state)
    assert state["epoch"] == 1
    assert state["global_step"] == 2 * 3
    assert weight_diff(state["model"], t.model.state_dict()) == 0.0
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert len(state["optimizer"]["state"]) == 4            # momentum buffers of 4 parameters
    assert state["config"]["batch_size"] == 16 and state["config"]["num_epochs"] == 2
    saved = state["callbacks"][f"ModelCheckpoint:model:Accuracy"]   # keyed by name, not list position
    assert (saved["best"], saved["best_epoch"]) == (ckpt.best, ckpt.best_epoch)
    assert saved["best_file"] == os.path.basename(ckpt.best_file)
    assert set(state["callbacks"]) == {"AccuracyRecorder:Accuracy", "ModelCheckpoint:model:Accuracy"}
    assert len(state["rng"]) == 1 and set(state["rng"][0]) >= {"python", "numpy", "torch"}  # one per rank
    assert state["epoch_complete"] is True and state["batch"] == 3
    assert checkpoint.is_resumable(state)


def test_state_dicts_are_unwrapped_from_data_parallel(tmp_path):
    wrapped = nn.DataParallel(TinyNet(4))   # runs on the CPU with no device ids
    ckpt = ModelCheckpoint(model_dir=str(tmp_path / "model"), indicator="Accuracy", start_save=-1)
    t = ToyTrainer(toy_cfg(n_train=32, n_test=16, num_epochs=1), callbacks=[AccuracyRecorder(), ckpt],
                   model=wrapped)
    assert isinstance(t.model, nn.DataParallel)
    t.run()
    expected = t.model.module.state_dict()
    for name in names(tmp_path / "model"):
        state = torch.load(tmp_path / "model" / name, weights_only=True)
        weights = state["model"] if name == "last.pth" else state
        assert not any(k.startswith("module.") for k in weights), name
        assert weight_diff(weights, expected) == 0.0
    assert len(names(tmp_path / "model")) == 3  # last, best, model_000


def test_extract_state_dict_and_load_weights_strip_module_prefix(tmp_path):
    torch.manual_seed(3)
    src = TinyNet(4)
    prefixed = nn.DataParallel(src).state_dict()
    assert all(k.startswith("module.") for k in prefixed)
    assert weight_diff(checkpoint.extract_state_dict(prefixed), src.state_dict()) == 0.0
    assert weight_diff(checkpoint.extract_state_dict({"state_dict": prefixed}), src.state_dict()) == 0.0
    torch.save(prefixed, tmp_path / "w.pth")
    dst = nn.DataParallel(TinyNet(4))
    torch_tools.load_weights(dst, str(tmp_path / "w.pth"))
    assert weight_diff(dst.module.state_dict(), src.state_dict()) == 0.0
    with pytest.raises(ValueError, match="do not fit.*missing keys"):
        torch_tools.load_weights(TinyNet(4, hidden=8, bn=True), src.state_dict())


# ----------------------------------------------------------------------------- atomic save / safe load
def test_atomic_save_keeps_old_file_when_save_fails(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pth")
    atomic.atomic_save({"w": torch.arange(4.0)}, path)
    before = open(path, "rb").read()

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        atomic.atomic_save({"w": torch.zeros(4)}, path)
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(4.0))
    assert os.listdir(tmp_path) == ["ckpt.pth"]  # no temp file left behind


# ----------------------------------------------------------------------------- background writes
def test_background_and_foreground_writes_give_the_same_files(tmp_path):
    files = {}
    for background in (False, True):
        folder = tmp_path / str(background)
        ckpt = ModelCheckpoint(model_dir=str(folder), indicator="Accuracy", start_save=None, async_save=background)
        ToyTrainer(toy_cfg(n_train=48, n_test=16, num_epochs=3, seed=3), callbacks=[AccuracyRecorder(), ckpt]).run()
        files[background] = {name: checkpoint.load_file(str(folder / name)) for name in names(folder)}
    assert files[True].keys() == files[False].keys() and len(files[True]) >= 4
    for name, a in files[False].items():
        b = files[True][name]
        weights_a, weights_b = checkpoint.extract_state_dict(a), checkpoint.extract_state_dict(b)
        assert weight_diff(weights_a, weights_b) == 0.0
        if name == "last.pth":
            assert a["epoch"] == b["epoch"] == 2
            for k, buf in a["optimizer"]["state"].items():
                assert torch.equal(buf["momentum_buffer"], b["optimizer"]["state"][k]["momentum_buffer"])
            assert a["rng"][0]["python"] == b["rng"][0]["python"]


def test_failed_background_write_stops_training_naming_the_file(tmp_path, monkeypatch):
    real_save = torch.save
    writes = []

    def failing_save(obj, f, *args, **kwargs):
        writes.append(getattr(f, "name", ""))
        if len(writes) == 2:   # epoch 1's last.pth (start_save=0: one file per epoch)
            raise OSError("No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    ckpt = ModelCheckpoint(model_dir=str(tmp_path / "model"), start_save=0)
    t = ToyTrainer(toy_cfg(n_train=32, num_epochs=4), callbacks=[ckpt])
    with pytest.raises(OSError, match="No space left") as info:
        t.run()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "the checkpoint of end of epoch 1 in " + str(tmp_path / "model") in notes
    assert t.epoch == 2        # raised at epoch 2's save, not at the end of training
    monkeypatch.undo()
    assert checkpoint.load_file(str(tmp_path / "model" / "last.pth"))["epoch"] == 0   # the old file is whole
    assert not glob.glob(str(tmp_path / "model" / ".*tmp*"))


def test_foreground_save_waits_for_the_background_one(tmp_path):
    import threading
    path = str(tmp_path / "last.pth")
    started, release = threading.Event(), threading.Event()

    def slow_old_write():
        started.set()
        release.wait(5)
        atomic.write_atomically({"epoch": torch.tensor(1)}, path)

    atomic.write_in_background(slow_old_write)
    started.wait(5)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    atomic.atomic_save({"epoch": torch.tensor(2)}, path)   # e.g. the preemption save
    assert int(checkpoint.load_file(path)["epoch"]) == 2       # the newer state is the one kept
    timer.join()


def test_snapshot_does_not_share_memory():
    live = {"w": torch.zeros(3), "nested": [torch.ones(2), 5, "x"], "t": (torch.zeros(1),)}
    copy = atomic.snapshot(live)
    live["w"].add_(1)
    live["nested"][0].add_(1)
    assert torch.equal(copy["w"], torch.zeros(3)) and torch.equal(copy["nested"][0], torch.ones(2))
    assert copy["nested"][1:] == [5, "x"] and isinstance(copy["t"], tuple)


def test_load_file_errors_name_the_file(tmp_path):
    missing = str(tmp_path / "nope.pth")
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        checkpoint.load_file(missing)

    empty = tmp_path / "empty.pth"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.pth.*empty"):
        checkpoint.load_file(str(empty))

    buf = io.BytesIO()
    torch.save({"w": torch.randn(64, 64)}, buf)
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(ValueError, match="truncated.pth.*truncated"):
        checkpoint.load_file(str(truncated))

    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint at all\n")
    with pytest.raises(ValueError, match="notes.pth"):
        checkpoint.load_file(str(text))

    malicious = tmp_path / "evil.pth"
    torch.save({"w": torch.zeros(1), "payload": Scripted("k", [])}, malicious)
    with pytest.raises(ValueError, match="evil.pth.*pickled"):
        checkpoint.load_file(str(malicious))
    with pytest.raises(ValueError, match="evil.pth"):
        torch_tools.load_state_dict(str(malicious))


def test_find_resumable_takes_the_newest_loadable_checkpoint(tmp_path, caplog):
    folder = checkpoint.CheckpointFolder(str(tmp_path))
    assert folder.find_resumable() is None                       # an empty folder: nothing to resume
    ckpt = ModelCheckpoint(model_dir=str(tmp_path), indicator="Accuracy", start_save=-1, async_save=False)
    ToyTrainer(toy_cfg(n_train=16, n_test=16, num_epochs=2), callbacks=[AccuracyRecorder(), ckpt]).run()
    path, state = folder.find_resumable()
    assert (path, state["epoch"]) == (folder.last, 1)
    assert checkpoint.load_file(folder.previous)["epoch"] == 0   # the one before is kept
    with open(folder.last, "r+b") as f:                          # torn by something outside the run
        f.truncate(100)
    with caplog.at_level("WARNING"):
        path, state = folder.find_resumable()
    assert (path, state["epoch"]) == (folder.previous, 0)
    assert "last.pth" in caplog.text and "last.prev.pth" in caplog.text
    torch.save({"w": torch.zeros(2)}, folder.previous)          # weights only: not resumable
    with pytest.raises(ValueError) as info:
        folder.find_resumable()
    assert "last.pth" in str(info.value) and "last.prev.pth" in str(info.value)


# ----------------------------------------------------------------------------- resume / finetune
def resume_trainer(work_dir, extra=(), **cfg):
    config = toy_cfg(n_train=48, n_test=16, num_epochs=4, work_dir=str(work_dir), momentum=0.9, shuffle=True,
                     seed=5, **cfg)
    model_dir = os.path.join(str(work_dir), "model")
    trainer = ToyTrainer(config, callbacks=[AccuracyRecorder(), *extra])
    sched = build_scheduler.get_scheduler("multi-step", trainer.optimizer, lr_init=0.1, num_epochs=4,
                                          num_steps=trainer.num_steps, milestones=[3])
    trainer.callbacks += [sched, ModelCheckpoint(model_dir=model_dir, indicator="Accuracy", start_save=0)]
    return trainer


def test_resume_auto_continues_and_equals_uninterrupted_run(tmp_path):
    full = resume_trainer(tmp_path / "full")
    full_history = full.run()

    first = resume_trainer(tmp_path / "work", extra=[StopAt(2)])
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        first.run()
    assert torch.load(tmp_path / "work" / "model" / "last.pth", weights_only=True)["epoch"] == 1

    rec = Recorder()
    second = resume_trainer(tmp_path / "work", extra=[rec], resume="auto")
    history = second.run()
    assert [r["epoch"] for r in history.epochs] == [2, 3]
    assert rec.events[1] == ("on_epoch_begin", 2)
    assert second.global_step == full.global_step == 4 * 3
    assert rec.lrs[-1] == pytest.approx(0.01)   # the schedule resumed at the right step
    assert weight_diff(second.model.state_dict(), full.model.state_dict()) <= 1e-6
    assert history["test/Accuracy"] == full_history["test/Accuracy"][2:]


def test_resume_from_weights_only_file_is_refused(tmp_path):
    first = resume_trainer(tmp_path, )
    first.cfg.num_epochs = first.num_epochs = 1
    first.run()
    best = glob.glob(str(tmp_path / "model" / "best_model_*.pth"))[0]
    second = resume_trainer(tmp_path, resume=best)
    with pytest.raises(ValueError, match="weights only"):
        second.run()


class FinetuneTrainer(ToyTrainer):
    """Loads ``cfg.finetune`` into the model the way examples/example.py does."""

    def build_model(self, cfg, **kwargs):
        model = super().build_model(cfg, **kwargs)
        if cfg.finetune:
            torch_tools.load_weights(model, torch_tools.load_state_dict(cfg.finetune), source=cfg.finetune)
        return model


def test_finetune_loads_weights_only(tmp_path):
    first = resume_trainer(tmp_path / "a")
    first.run()
    last = str(tmp_path / "a" / "model" / "last.pth")
    rec = Recorder()
    weights_at_start = {}

    class Snapshot(Callback):
        def on_train_begin(self, logs=None):
            weights_at_start.update({k: v.clone() for k, v in self.trainer.model.state_dict().items()})
            weights_at_start["momentum_buffers"] = torch.tensor(len(self.trainer.optimizer.state))

    tuned = FinetuneTrainer(toy_cfg(n_train=48, num_epochs=1, finetune=last, seed=11), callbacks=[Snapshot(), rec])
    tuned.run()
    assert rec.events[1] == ("on_epoch_begin", 0)          # starts at epoch 0, not where `last` ended
    assert int(weights_at_start.pop("momentum_buffers")) == 0   # a fresh optimizer
    assert weight_diff(weights_at_start, first.model.state_dict()) == 0.0
    assert tuned.global_step == 3


def test_non_finite_names_exactly_the_tensors_with_nan_or_inf_also_when_a_sum_overflows():
    from basetrainer.runtime.checkpoint import non_finite

    nan, inf = float("nan"), float("inf")
    weights = {"nan": torch.tensor([1.0, nan]), "inf": torch.tensor([inf, 1.0]), "both": torch.tensor([-inf, inf]),
               "big32": torch.tensor([3e38, 3e38]), "big16": torch.tensor([6e4, 6e4], dtype=torch.float16),
               "nan_bf16": torch.tensor([1.0, nan], dtype=torch.bfloat16),
               "big64": torch.tensor([1e308, 1e308], dtype=torch.float64), "ints": torch.tensor([1, 2]),
               "fine": torch.randn(100, 100)}
    assert non_finite(weights) == ["nan", "inf", "both", "nan_bf16"]
