"""A full disk gives one clear error (the folder, the bytes needed, the previous last.pth intact)
and loses nothing: on a real 1 MB tmpfs (a private mount namespace, when running as root), and
with a writer that fails the way torch does when the disk fills up (always)."""
import errno
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

from conftest import ROOT, ToyTrainer, toy_cfg

PY = sys.executable


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _temps(folder):
    return [p for p in glob.glob(os.path.join(str(folder), ".*")) if ".tmp" in os.path.basename(p)]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_write_that_fails_for_lack_of_space_names_the_folder_and_keeps_last_pth(tmp_path, monkeypatch,
                                                                                   async_save):
    real_save = torch.save
    calls = {"n": 0}

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("epoch") == 1 and "optimizer" in obj:
            calls["n"] += 1
            f.write(b"\0" * 100)   # what torch's zip writer does when the disk fills up:
            try:                   # the OSError becomes the context of a RuntimeError
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    folder = tmp_path / "model"
    t = ToyTrainer(toy_cfg(num_epochs=3, n_train=32, n_test=16),
                   callbacks=[LossesRecorder(), ModelCheckpoint(model_dir=str(folder), indicator="loss",
                                                                async_save=async_save)])
    with pytest.raises(OSError) as err:
        t.run()
    message = str(err.value)
    assert calls["n"] >= 1
    assert err.value.errno == errno.ENOSPC
    assert str(folder) in message and "intact" in message and "last.pth" in message
    assert "unexpected pos" not in message.split("\n")[0]     # torch's words are not the headline
    assert _load(str(folder / "last.pth"))["epoch"] == 0     # the previous last.pth, whole
    assert _temps(folder) == []


SCRIPT = textwrap.dedent("""
    import glob, json, os, sys, time, traceback
    sys.path.insert(0, {tests!r})
    import torch
    from conftest import ToyTrainer, TinyNet, toy_cfg
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

    class FillDisk(Callback):
        # after epoch 0's files are written, leave less room than a checkpoint needs
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                last = os.path.join(folder, "model", "last.pth")
                for _ in range(3000):  # epoch 0's files may still be written in the background
                    if os.path.exists(last):
                        break
                    time.sleep(0.01)
                time.sleep(0.2)
                st = os.statvfs(folder)
                free = st.f_bavail * st.f_frsize
                with open(os.path.join(folder, "filler"), "wb") as f:
                    f.write(b"\\0" * max(0, free - 48 * 1024))

    folder, async_save = sys.argv[1], sys.argv[2] == "1"
    result = {{}}
    try:
        t = ToyTrainer(toy_cfg(num_epochs=3, n_train=32, n_test=16),
                       callbacks=[LossesRecorder(), FillDisk(),
                                  ModelCheckpoint(model_dir=os.path.join(folder, "model"), indicator="loss",
                                                  async_save=async_save)],
                       model=TinyNet(hidden=2048))
        t.run()
    except BaseException as e:
        result["error"] = type(e).__name__ + ": " + str(e)
        result["errno"] = getattr(e, "errno", None)
    try:
        result["last_epoch"] = torch.load(os.path.join(folder, "model", "last.pth"), weights_only=True)["epoch"]
    except Exception as e:
        result["last_epoch"] = "unloadable: " + str(e)
    result["temps"] = [p for p in os.listdir(os.path.join(folder, "model")) if ".tmp" in p]
    print("RESULT " + json.dumps(result))
""")


def _tmpfs_available():
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs in a private mount namespace"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs here: {probe.stderr.strip()}"
    return None


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_on_a_real_small_filesystem(tmp_path, async_save):
    reason = _tmpfs_available()
    if reason:
        pytest.skip(reason)
    script = tmp_path / "fill.py"
    script.write_text(SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    mount = tmp_path / "disk"
    mount.mkdir()
    cmd = (f"mount -t tmpfs -o size=1m tmpfs {mount} && "
           f"exec {PY} {script} {mount} {'1' if async_save else '0'}")
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(line[0][len("RESULT "):])
    assert result.get("errno") == errno.ENOSPC, result
    error = result["error"]
    assert str(mount / "model") in error and "intact" in error, error
    assert result["last_epoch"] == 0, result        # the previous last.pth, whole
    assert result["temps"] == [], result
