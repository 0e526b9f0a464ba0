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


@pytest.mark.distributed
@pytest.mark.slow
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


# ----------------------------------------------------------------------------- sharded saves (strategy: fsdp)
SHARDED_SCRIPT = textwrap.dedent("""
    import json, os, sys, traceback
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
    from basetrainer.engine.launch import launch
    from fsdp_common import BlockTrainer, fsdp_cfg, full_weights

    disk, slack, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    class FillDisk(Callback):
        # rank 0, after step 4 (the step-3 save is on disk): leave `slack` bytes free for the step-6 save
        def on_batch_end(self, batch, logs=None):
            if self.trainer.rank == 0 and self.trainer.global_step == 4 and slack >= 0:
                st = os.statvfs(disk)
                with open(os.path.join(disk, "filler"), "wb") as f:
                    f.write(b"\\0" * max(0, st.f_bavail * st.f_frsize - slack))

    def main(_):
        work = os.path.join(disk, "work")
        rank = int(os.environ["RANK"])
        result = {{"error": None}}
        try:
            cb = [ModelCheckpoint(model_dir=os.path.join(work, "model"), save_freq_steps=3, async_save=False),
                  FillDisk()]
            t = BlockTrainer(fsdp_cfg(strategy="fsdp", work_dir=work, distributed=True, num_epochs=2,
                                      resume="auto" if slack < 0 else ""), callbacks=cb)
            t.run()
            weights = full_weights(t)
            if rank == 0:
                torch.save(weights, os.path.join(out, "final.pt"))
        except BaseException as e:
            result = {{"type": type(e).__name__, "error": str(e), "errno": getattr(e, "errno", None)}}
            raise
        finally:
            with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
                json.dump(result, f)

    if __name__ == "__main__":
        try:
            launch(main, num_gpus_per_machine=2, dist_url="auto", distributed=True, args=(None,), backend="gloo")
            top = {{"error": None}}
        except BaseException as e:
            top = {{"type": type(e).__name__, "error": str(e)}}
        with open(os.path.join(out, "top.json"), "w") as f:
            json.dump(top, f)
""")


def _sharded_runs(tmp_path, mount, slacks):
    """Run the script once per entry of ``slacks`` (< 0: resume, the disk's filler removed) on
    one 1 MB tmpfs; return each run's (launcher's error, ranks' results) and a copy of the disk."""
    script = tmp_path / "fill_sharded.py"
    script.write_text(SHARDED_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
    runs = [tmp_path / f"run{i}" for i in range(len(slacks))]
    steps = []
    for out, slack in zip(runs, slacks):
        out.mkdir()
        steps.append(f"rm -f {mount}/filler; {PY} {script} {mount} {slack} {out}")
    # the tmpfs lives in this command's mount namespace: mounted, used and gone with it
    cmd = f"mount -t tmpfs -o size=1m tmpfs {mount} && {{ {'; '.join(steps)}; tar -C {mount} -cf {tmp_path}/disk.tar . ; }}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    results = []
    for out in runs:
        assert (out / "top.json").exists(), done.stdout[-2000:] + done.stderr[-3000:]
        results.append((json.loads((out / "top.json").read_text()),
                        [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]))
    disk = tmp_path / "disk_copy"
    disk.mkdir()
    subprocess.run(["tar", "-C", str(disk), "-xf", str(tmp_path / "disk.tar")], check=True)
    return results, disk


# free bytes left for the step-6 save, whose files take about 40 KB per rank's shard, 9 KB of
# metadata and 33 KB of last.pth (tmpfs counts 4 KB pages): where the disk fills up
FILL_POINTS = {"nothing": 0, "both_shards_short": 20 * 1024, "one_shard": 44 * 1024, "metadata": 84 * 1024,
               "pointer": 100 * 1024}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("point", sorted(FILL_POINTS))
def test_disk_full_during_a_sharded_save(tmp_path, point):
    """Issue 28.4: one DiskFullError (not DCP's CheckpointException, a BaseException with a
    traceback per rank, nor a bare 'unexpected pos' on the other rank), the same on every
    rank, naming the folder; the previous last.pth and its shards intact, the partial save gone."""
    from basetrainer.runtime import checkpoint, sharded

    reason = _tmpfs_available()
    if reason:
        pytest.skip(reason)
    mount = tmp_path / "disk"
    mount.mkdir()
    [(top, ranks)], disk = _sharded_runs(tmp_path, mount, [FILL_POINTS[point]])
    folder = str(mount / "work" / "model")
    assert [r["type"] for r in ranks] == ["DiskFullError", "DiskFullError"], ranks
    assert [r["errno"] for r in ranks] == [errno.ENOSPC, errno.ENOSPC]
    assert ranks[0]["error"] == ranks[1]["error"]                # one error, told to every rank
    message = ranks[0]["error"]
    assert f"no space left in {folder}" in message and "intact (epoch 0 after step 3)" in message, message
    assert "CheckpointException" not in top["error"] and "unexpected pos" not in message
    assert f"DiskFullError: [Errno 28] no space left in {folder}" in top["error"]
    local = str(disk / "work" / "model")
    state = checkpoint.load_file(os.path.join(local, "last.pth"))
    assert checkpoint.position(state) == (0, "train", 3)         # the previous save, whole
    sharded.check(state, local)                                  # and its shards: every tensor loads
    assert sorted(n for n in os.listdir(local) if n.startswith(sharded.PREFIX)) == [state["shards"]]
    assert _temps(local) == [] and not os.path.exists(os.path.join(local, "last.prev.pth"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sharded_run_continues_after_space_is_freed(tmp_path):
    """As the error says: free some space and continue with resume: auto; the run ends where an
    uninterrupted one-process run ends."""
    from conftest import weight_diff
    from fsdp_common import BlockTrainer, fsdp_cfg, full_weights

    reason = _tmpfs_available()
    if reason:
        pytest.skip(reason)
    mount = tmp_path / "disk"
    mount.mkdir()
    (first, _), (second, ranks) = _sharded_runs(tmp_path, mount, [FILL_POINTS["one_shard"], -1])[0]
    assert "DiskFullError" in first["error"]
    assert second["error"] is None and [r["error"] for r in ranks] == [None, None], (second, ranks)
    reference = BlockTrainer(fsdp_cfg(strategy="ddp", distributed=False, num_epochs=2))
    reference.run()
    resumed = torch.load(tmp_path / "run1" / "final.pt", weights_only=True)
    assert weight_diff(full_weights(reference), resumed) < 1e-5


def test_a_rank_s_lack_of_space_survives_the_trip_to_the_other_ranks():
    """DCP pickles each rank's error to the others, which drops its context: torch's zip writer's
    'unexpected pos' (the ENOSPC only its context) arrived as a bare RuntimeError. The writer
    raises the ENOSPC itself; other DCP failures become a RuntimeError (CheckpointException is a
    BaseException that `except Exception` lets through)."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    from basetrainer.runtime import shard_io

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:
        short = e
    with pytest.raises(OSError) as err:
        shard_io._raise_space_error(short, rank=1)
    travelled = pickle.loads(pickle.dumps(err.value))
    assert travelled.errno == errno.ENOSPC and "rank 1" in str(travelled)
    assert pickle.loads(pickle.dumps(short)).__context__ is None      # what happened without it
    shard_io._raise_space_error(RuntimeError("other"), rank=0)            # not a space error: nothing raised
    other = shard_io.failure(CheckpointException("write", {1: (ValueError("bad plan"), None)}), "writing X")
    assert isinstance(other, RuntimeError) and str(other) == "writing X failed on rank(s) [1]; rank 1: ValueError: bad plan"
