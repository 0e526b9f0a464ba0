"""The start_save config key: best + last by default, per-epoch weights only when asked; the
ModelCheckpoint class keeps the original's meaning of None/-1 (the last ``keep`` epochs)."""
import os
import re

import pytest

from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from basetrainer.utils import setup_config
from conftest import ToyTrainer, toy_cfg


def _files_after_run(folder, start_save):
    cfg = toy_cfg(n_train=64, n_test=32, num_epochs=3)
    if start_save != "default":
        cfg.start_save = start_save
    t = ToyTrainer(cfg, callbacks=[AccuracyRecorder()])
    t.callbacks.append(ModelCheckpoint(model_dir=str(folder), indicator="Accuracy", start_save=cfg.start_save))
    t.run()
    return cfg.start_save, sorted(f for f in os.listdir(folder) if not f.startswith("."))   # not the run marker


def test_config_default_keeps_best_and_last_only(tmp_path):
    assert setup_config.engine_defaults().start_save == 0
    start_save, files = _files_after_run(tmp_path / "model", "default")
    assert start_save == 0
    assert len(files) == 3 and files[1:] == ["last.prev.pth", "last.pth"], files   # last and the one before
    assert re.fullmatch(r"best_model_00[0-2]_\d\.\d{4}\.pth", files[0])


@pytest.mark.parametrize("start_save,epoch_files", [(None, 3), (-1, 3), (1, 2)])
def test_per_epoch_files_when_asked(tmp_path, start_save, epoch_files):
    _, files = _files_after_run(tmp_path / "model", start_save)
    assert len([f for f in files if f.startswith("model_")]) == epoch_files, files
    assert "last.pth" in files and len([f for f in files if f.startswith("best_model_")]) == 1
