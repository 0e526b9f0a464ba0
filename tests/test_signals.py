"""Signals to the whole process group (what ``scancel`` and ``kill -- -PGID`` do), with DataLoader
workers: the documented preemption (finish the step, write last.pth, exit 128 + signal), in one
process and in DDP; and ``launch()`` leaves no worker process behind when a rank fails."""
import csv
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.log_history import LogHistory
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.metric.accuracy_recorder import AccuracyRecorder

from conftest import ROOT, ToyTrainer, script_fixture, start_script, toy_cfg, weight_diff

PY = sys.executable

SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {tests!r})
    from conftest import ToyTrainer, toy_cfg
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
    from basetrainer.engine.launch import launch

    def note_worker(worker_id):
        open(os.path.join(os.environ["PIDS"], str(os.getpid())), "w").close()

    class Trainer(ToyTrainer):
        def build_train_loader(self, cfg, **kwargs):
            from conftest import blobs
            return self.build_dataloader(blobs(96, 4, seed=0), cfg.batch_size, cfg.num_workers, phase="train",
                                         worker_init_fn=note_worker)

    class Pause(Callback):
        # tells the test it may send the signal now, then keeps this step busy for a while
        def on_batch_end(self, batch, logs=None):
            if (self.trainer.epoch, batch) == (1, 2) and self.trainer.rank == 0:
                open(os.path.join(os.environ["WORK"], "ready"), "w").close()
                time.sleep(3)

    def main(work, workers, resume, pause):
        cfg = toy_cfg(num_epochs=int(os.environ.get("EPOCHS", "3")), batch_size=16, num_workers=workers,
                      work_dir=work, resume=resume,
                      log_freq=2, distributed=os.environ.get("DDP") == "1",
                      strategy=os.environ.get("STRATEGY", "ddp"))
        callbacks = [LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss")]
        if pause:
            callbacks.append(Pause())
        t = Trainer(cfg, callbacks=callbacks)
        t.run()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        weights = get_model_state_dict(t.unwrapped_model, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
        if t.rank == 0:
            torch.save(weights, os.path.join(work, "final.pt"))

    if __name__ == "__main__":
        work, workers, resume, pause = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
        os.environ.update(WORK=work, PIDS=os.path.join(work, "pids"))
        os.makedirs(os.environ["PIDS"], exist_ok=True)
        if os.environ.get("DDP") == "1":
            launch(main, num_gpus_per_machine=2, distributed=True, args=(work, workers, resume, pause))
        else:
            main(work, workers, resume, pause)
""")


script = script_fixture(SCRIPT, "train_signal.py")


def _start(script, work, workers, resume="", pause=False, ddp=False, strategy="ddp"):
    env = dict(os.environ, DDP="1" if ddp else "0", PYTHONUNBUFFERED="1", EPOCHS="2" if ddp else "3",
               STRATEGY=strategy)
    return start_script(script, work, workers, resume, "1" if pause else "0", env=env,
                        new_session=True)    # its own process group, as under SLURM


def _finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"did not finish in {timeout} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _worker_pids(work):
    folder = os.path.join(str(work), "pids")
    return [int(p) for p in os.listdir(folder)] if os.path.isdir(folder) else []


def _signal_group_when_ready(proc, work, sig):
    ready = os.path.join(str(work), "ready")
    deadline = time.monotonic() + 180
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            _, out, err = _finish(proc)
            pytest.fail(f"never reached the pause (exit {proc.returncode}):\n{err[-3000:]}")
        time.sleep(0.05)
    os.killpg(proc.pid, sig)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, script):
    """The script's 3-epoch run with no signal and no workers: what every preempted and resumed
    run must end with, whatever its num_workers (the data set draws nothing at random)."""
    folder = tmp_path_factory.mktemp("signal_ref")
    code, _, err = _finish(_start(script, folder / "ref", 0))
    assert code == 0, err[-3000:]
    return torch.load(folder / "ref" / "final.pt", weights_only=True)


# without workers, SIGTERM and an exact resume are tested in test_resume (the signal reaches the
# one process either way); here: the DataLoader workers in the process group get it too
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 4])
def test_sigterm_to_the_process_group_preempts_cleanly(tmp_path, script, workers, uninterrupted):
    work = tmp_path / "run"
    proc = _start(script, work, workers, pause=True)
    _signal_group_when_ready(proc, work, signal.SIGTERM)
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "resume" in err and "last.pth" in err
    assert "DataLoader worker" not in err
    state = torch.load(work / "model" / "last.pth", weights_only=True)
    assert (state["epoch"], state["epoch_complete"], state["batch"]) == (1, False, 3)  # after the step
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in _worker_pids(work)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in _worker_pids(work) if _alive(p)]
    code, _, err = _finish(_start(script, work, workers, resume="auto"))
    assert code == 0, err[-3000:]
    assert weight_diff(uninterrupted, torch.load(work / "final.pt", weights_only=True)) <= 1e-6


@pytest.mark.distributed
@pytest.mark.slow
def test_sigint_to_the_process_group_exits_130(tmp_path, script):
    work = tmp_path / "run"
    proc = _start(script, work, 2, pause=True)
    _signal_group_when_ready(proc, work, signal.SIGINT)
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGINT, err[-3000:]
    assert torch.load(work / "model" / "last.pth", weights_only=True)["batch"] == 3


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("first,again", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)])
def test_one_request_delivered_twice_still_preempts_cleanly(tmp_path, script, first, again):
    # `timeout` (and many launchers) pass a signal on to the child and to its group: one request
    # arrives twice within milliseconds. It once counted as a second Ctrl-C: KeyboardInterrupt,
    # no checkpoint, the epoch's steps lost
    work = tmp_path / "run"
    proc = _start(script, work, 2, pause=True)
    _signal_group_when_ready(proc, work, first)
    time.sleep(0.05)
    os.killpg(proc.pid, again)
    code, _, err = _finish(proc)
    assert code == 128 + first, err[-3000:]            # the first signal decides the status
    assert "KeyboardInterrupt" not in err
    assert torch.load(work / "model" / "last.pth", weights_only=True)["batch"] == 3


@pytest.mark.distributed
@pytest.mark.slow
def test_one_ctrl_c_delivered_twice_to_a_ddp_job_preempts_every_rank(tmp_path, script):
    work = tmp_path / "run"
    proc = _start(script, work, 0, pause=True, ddp=True)
    _signal_group_when_ready(proc, work, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGINT, err[-3000:]      # once: exit 1, a rank killed, no checkpoint
    assert (torch.load(work / "model" / "last.pth", weights_only=True)["batch"]) == 4


@pytest.mark.distributed
@pytest.mark.slow
def test_a_second_ctrl_c_a_second_later_stops_at_once(tmp_path, script):
    work = tmp_path / "run"
    proc = _start(script, work, 0, pause=True)
    _signal_group_when_ready(proc, work, signal.SIGINT)
    time.sleep(1.5)                                     # inside the paused step (3 s)
    os.killpg(proc.pid, signal.SIGINT)
    code, _, err = _finish(proc)
    assert code in (-signal.SIGINT, 128 + signal.SIGINT, 1), err[-3000:]
    assert "KeyboardInterrupt" in err                   # at once: no preemption checkpoint
    assert torch.load(work / "model" / "last.pth", weights_only=True)["epoch_complete"] is True


def _reference(work):
    """The script's 2-epoch run, uninterrupted, in this process (DDP equals one process)."""
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

    cfg = toy_cfg(num_epochs=2, batch_size=16, n_train=96, work_dir=str(work), log_freq=2)
    t = ToyTrainer(cfg, callbacks=[LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(str(work), "model"),
                                                                     indicator="loss")])
    t.run()
    return {k: v.detach().clone() for k, v in t.unwrapped_model.state_dict().items()}


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_a_ddp_or_fsdp_job_stops_every_rank_with_the_same_status(tmp_path, script):
    reference = _reference(tmp_path / "ref")
    for strategy in ("ddp", "fsdp"):   # fsdp: every rank writes its shards of the preemption checkpoint
        work = tmp_path / strategy
        proc = _start(script, work, 2, pause=True, ddp=True, strategy=strategy)
        _signal_group_when_ready(proc, work, signal.SIGTERM)
        code, _, err = _finish(proc)
        assert code == 128 + signal.SIGTERM, err[-3000:]     # the launcher, after every rank did the same
        assert "DataLoader worker" not in err
        state = torch.load(work / "model" / "last.pth", weights_only=True)
        # the ranks agree at the next log point (log_freq=2): after step index 3
        assert (state["epoch"], state["epoch_complete"], state["batch"]) == (1, False, 4)
        assert bool(state.get("shards")) == (strategy == "fsdp")
        assert not [p for p in _worker_pids(work) if _alive(p)]
        if strategy == "fsdp":   # every rank's shard is complete (a resume of it is tested in test_fsdp)
            from basetrainer.runtime import checkpoint

            assert checkpoint.CheckpointFolder(str(work / "model")).find_resumable()[0].endswith("last.pth")
            continue
        code, _, err = _finish(_start(script, work, 2, resume="auto", ddp=True, strategy=strategy))
        assert code == 0, err[-3000:]
        assert weight_diff(reference, torch.load(work / "final.pt", weights_only=True)) <= 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_sigint_to_the_launcher_alone_is_passed_on_and_it_exits_130(tmp_path, script):
    work = tmp_path / "run"
    proc = _start(script, work, 0, pause=True, ddp=True)
    ready = os.path.join(str(work), "ready")
    deadline = time.monotonic() + 180
    while not os.path.exists(ready) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)                 # the launcher only, not its process group
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGINT, err[-3000:]  # its own signal; the ranks got SIGTERM from it
    assert torch.load(work / "model" / "last.pth", weights_only=True)["phase"] == "train"


LEFTOVER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    from torch.utils.data import Dataset
    from conftest import ToyTrainer, blobs, toy_cfg
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.engine.launch import launch

    class Stuck(Dataset):
        # on rank 1, item 40 never comes back (a worker blocked in I/O, say)
        def __init__(self):
            self.data = blobs(96, 4, seed=0)
        def __len__(self):
            return len(self.data)
        def __getitem__(self, i):
            if i == 40 and os.environ.get("RANK") == "1":
                time.sleep(600)
            return self.data[i]

    def note(worker_id):
        open(os.path.join(os.environ["PIDS"], str(os.getpid())), "w").close()

    class Trainer(ToyTrainer):
        def build_train_loader(self, cfg, **kwargs):
            return self.build_dataloader(Stuck(), cfg.batch_size, 2, phase="train", shuffle=False,
                                         worker_init_fn=note)

    class Fail(Callback):
        def on_batch_end(self, batch, logs=None):
            if batch == 1 and self.trainer.rank == 0:
                raise RuntimeError("rank 0 fails on purpose")

    def main():
        Trainer(toy_cfg(num_epochs=2, batch_size=16, distributed=True), callbacks=[Fail()]).run()

    if __name__ == "__main__":
        os.environ["PIDS"] = sys.argv[1]
        try:
            launch(main, num_gpus_per_machine=2, distributed=True)
        except BaseException as e:
            print("LAUNCH RAISED " + type(e).__name__, flush=True)
        def running(pid):  # alive and not a zombie
            try:
                with open("/proc/%s/stat" % pid) as f:
                    return f.read().split(")")[-1].split()[0] != "Z"
            except OSError:
                return False
        print("ALIVE " + " ".join(p for p in os.listdir(sys.argv[1]) if running(p)), flush=True)
""")


@pytest.mark.distributed
@pytest.mark.slow
def test_launch_returns_only_after_the_ranks_worker_processes_are_gone(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "leftover.py"
    script.write_text(LEFTOVER.format(tests=os.path.join(ROOT, "tests")))
    proc = subprocess.Popen([PY, str(script), str(pids)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=str(tmp_path))   # its failure report: tmp_path/log
    try:
        out, err = proc.communicate(timeout=240)
        assert "LAUNCH RAISED" in out, err[-3000:]
        assert len(os.listdir(pids)) >= 2, out          # the workers did start
        alive = [line for line in out.splitlines() if line.startswith("ALIVE")][0].split()[1:]
        assert alive == [], (out, err[-3000:])     # right when launch() returned
    finally:
        for p in os.listdir(pids):
            if _alive(int(p)):
                os.kill(int(p), signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


class _SignalAt(Callback):
    """Sends this process SIGTERM in test batch ``batch`` of ``epoch``, or in that epoch's end."""

    def __init__(self, where, epoch, batch=0):
        super().__init__()
        self.where, self.at = where, (epoch, batch)

    def on_test_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        if self.where == "test" and (epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_epoch_end(self, epoch, logs=None):
        if self.where == "epoch_end" and epoch == self.at[0]:
            os.kill(os.getpid(), signal.SIGTERM)


def _toy(work, extra=(), resume=""):
    callbacks = [LossesRecorder(), AccuracyRecorder(target_names=["a", "b", "c", "d"]),
                 LogHistory(log_dir=os.path.join(work, "log"), log_freq=2),
                 ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="Accuracy", async_save=False),
                 *extra]
    return ToyTrainer(toy_cfg(num_epochs=3, n_train=64, n_test=48, batch_size=16, momentum=0.9, work_dir=work,
                              resume=resume), callbacks=callbacks)


def _rows(work):
    with open(os.path.join(work, "log", "history.csv"), newline="") as f:
        return [{k: v for k, v in row.items() if k != "epoch_time" and not k.startswith("data_wait")}   # timings
                for row in csv.DictReader(f)]


@pytest.mark.parametrize("where,position", [("test", (1, "test")), ("epoch_end", (1, "end"))])
def test_a_signal_in_the_test_phase_or_at_the_epoch_end_resumes_exactly(tmp_path, where, position):
    ref = _toy(str(tmp_path / "ref"))
    ref.run()
    work = str(tmp_path / "run")
    with pytest.raises(SystemExit) as stop:
        _toy(work, [_SignalAt(where, 1, 1)]).run()
    assert stop.value.code == 128 + signal.SIGTERM
    state = torch.load(os.path.join(work, "model", "last.pth"), weights_only=True)
    assert (state["epoch"], state["phase"]) == position
    resumed = _toy(work, resume="auto")
    resumed.run()
    assert weight_diff(ref.unwrapped_model.state_dict(), resumed.unwrapped_model.state_dict()) <= 1e-6
    assert _rows(work) == _rows(str(tmp_path / "ref"))   # every epoch once, the same figures
