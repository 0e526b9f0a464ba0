"""The run's state is declared (basetrainer/engine/registry.py, callbacks/callbacks.py): the
checkpointer's registry holds every stateful object under a stable key, a save and a resume each
pass over it once, and callbacks declare their state and their folders through ``Callback``
methods. Nothing is found by probing attribute names, so a misspelt method is named in a warning
instead of being silently left out of the checkpoint."""
import ast
import importlib
import logging
import os
import pkgutil

import pytest
import torch

import basetrainer
from basetrainer.callbacks import callbacks as callbacks_mod
from basetrainer.callbacks.callbacks import Callback, CallbackList
from basetrainer.runtime import checkpoint

from conftest import ROOT, ToyTrainer, toy_cfg

CFG = dict(n_train=32, n_test=16, batch_size=16)


class EpochCounter(Callback):
    """Counts the epochs it saw, keeps its state under ``counter:<name>`` and wants the run's
    ``last.pth`` in its own folder (no ModelCheckpoint in the run)."""

    def __init__(self, folder: str, name: str = "a") -> None:
        super().__init__()
        self.folder, self.name, self.epochs, self.loaded = folder, name, 0, None

    @property
    def state_key(self) -> str:
        return f"counter:{self.name}"

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.loaded = dict(state)
        self.epochs = int(state["epochs"])

    def last_checkpoint_dir(self):
        return self.folder

    def run_folders(self):
        return [self.folder]

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1
        self.trainer.request_checkpoint(background=False)


def test_a_callback_declaring_its_state_and_folder_is_saved_there_and_restored_under_its_key(tmp_path):
    folder = str(tmp_path / "ckpt")
    first = EpochCounter(folder)
    ToyTrainer(toy_cfg(num_epochs=2, **CFG), callbacks=[first]).run()
    state = checkpoint.load_file(os.path.join(folder, "last.pth"))
    assert state["callbacks"]["counter:a"] == {"epochs": 2}
    assert (state["epoch"], state["phase"], state["global_step"]) == (1, "end", 4)

    again = EpochCounter(folder)
    resumed = ToyTrainer(toy_cfg(num_epochs=3, resume="auto", **CFG), callbacks=[again])
    resumed.run()
    assert again.loaded == {"epochs": 2}                  # restored under its key ...
    assert again.epochs == 3 and resumed.global_step == 6   # ... and the run went on from epoch 2
    assert checkpoint.load_file(os.path.join(folder, "last.pth"))["callbacks"]["counter:a"] == {"epochs": 3}


def test_the_checkpoint_keeps_format_1s_keys_one_pass_over_the_registry_writes(tmp_path):
    t = ToyTrainer(toy_cfg(num_epochs=1, **CFG), callbacks=[EpochCounter(str(tmp_path / "c"))])
    registry = t.checkpointer.registry()
    assert list(registry.parts) == ["format", "position", "sampler", "model", "scaler", "callbacks", "rng", "world",
                                    "config", "stopped"]
    assert set(t.state_dict()) == {"format", "run_id", "epoch", "phase", "epoch_complete", "batch", "epoch_plan",
                                   "global_step", "model", "optimizer", "scaler", "callbacks", "rng", "world_size",
                                   "config", "logs", "stopped"}


class Misspelt(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.best = 0.5

    def state_dic(self):   # meant state_dict: the engine never calls it
        return {"best": self.best}

    def on_epoch_ends(self, epoch, logs=None):   # meant on_epoch_end
        pass


def test_a_misspelt_method_is_named_in_a_warning_not_silently_dropped(caplog):
    with caplog.at_level(logging.WARNING, logger="basetrainer.callbacks.callbacks"):
        ToyTrainer(toy_cfg(num_epochs=1, **CFG), callbacks=[Misspelt(), Misspelt()]).run()
    lines = [r.getMessage() for r in caplog.records if "never calls" in r.getMessage()]
    assert lines == ["callback Misspelt defines on_epoch_ends(), which the engine never calls: did you mean "
                     "on_epoch_end()? (on_epoch_end is the name the engine uses)",
                     "callback Misspelt defines state_dic(), which the engine never calls: did you mean "
                     "state_dict()? (state_dict is the name the engine uses)"]


def _library_callbacks():
    for info in pkgutil.walk_packages(basetrainer.__path__, "basetrainer."):
        if info.name.split(".")[1] in ("callbacks", "metric", "scheduler", "pruning"):
            try:
                importlib.import_module(info.name)
            except ImportError:   # an optional extra that is not installed
                pass
    found, todo = set(), [Callback]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("basetrainer.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted(found, key=lambda k: k.__qualname__)


def test_no_library_callback_looks_misspelt():
    kinds = _library_callbacks()
    assert len(kinds) >= 10
    assert {k.__name__: callbacks_mod.misspellings(k) for k in kinds if callbacks_mod.misspellings(k)} == {}


def test_an_object_that_is_not_a_callback_is_refused_naming_the_fix():
    class Duck:
        def on_epoch_end(self, epoch, logs=None):
            pass

    with pytest.raises(TypeError, match=r"callbacks\[1\] is a Duck, not a Callback: subclass basetrainer.Callback"):
        CallbackList([Callback(), Duck()], trainer=None)


# names the engine and the callbacks once probed callbacks for (hasattr / getattr with a default)
PROBED = {"model_dir", "log_dir", "save_last", "run_files", "prepare_state", "state_key", "state_dict",
          "load_state_dict", "set_trainer", "set_model", "mode_of", "test_weights", "best_file", "rows", "sinks",
          "writer", "_mode_given", "last_checkpoint_dir", "run_folders", "is_main_process", "ema", "trainer"}


def test_the_library_probes_no_callback_for_its_state_or_files():
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "basetrainer")):
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                        node.func.id in ("hasattr", "getattr") and len(node.args) >= 2 and \
                        isinstance(node.args[1], ast.Constant) and node.args[1].value in PROBED:
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_evaluation_restores_the_trainers_fields_also_when_its_body_raises(tmp_path):
    t = ToyTrainer(toy_cfg(num_epochs=1, **CFG))
    weights = str(tmp_path / "weights.pth")   # evaluation() loads it (and names it)
    torch.save(t.unwrapped_model.state_dict(), weights)
    before = (t.test_loader, t._callbacks, t.evaluating, t.evaluating_checkpoint)
    loader = t.build_dataloader(torch.utils.data.TensorDataset(torch.zeros(4, 16), torch.zeros(4).long()), 4, 0,
                                phase="test", shuffle=False)
    t.model.train()
    with pytest.raises(RuntimeError, match="inside"):
        with t.evaluation(loader, checkpoint=weights):
            assert (t.test_loader, t.evaluating, t.evaluating_checkpoint) == (loader, True, weights)
            assert t._callbacks is not before[1]
            t.model.eval()
            raise RuntimeError("inside")
    assert (t.test_loader, t._callbacks, t.evaluating, t.evaluating_checkpoint) == before
    assert t.model.training
