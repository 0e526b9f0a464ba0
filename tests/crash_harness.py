"""Runs toy trainings that die at an exact file-write boundary, for tests/test_crash_safety.py.

Usage: ``python crash_harness.py cases.json``. Each case is a dict (see :func:`train`); the
harness imports torch and basetrainer once, then forks one child per case (as many at once as
there are cores, up to 4), so a case costs a fraction of a second. The parent process runs no
torch operation (a fork after one could hang the child's thread pool).

A case may name ``kill_at``: the index of the write event at which the child SIGKILLs itself.
Write events are counted in order over the whole run: ``open`` (a temp file is about to be
created), ``fsync``, ``replace`` (before ``os.replace``), ``replaced`` (after it), ``link`` and
``remove``. With ``events`` the child writes the sequence of events to that file.

Only the public API of basetrainer is used, so the harness runs against any version.
"""
import builtins
import json
import os
import signal
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from basetrainer.callbacks.callbacks import Callback  # noqa: E402
from basetrainer.callbacks.log_history import LogHistory  # noqa: E402
from basetrainer.callbacks.losses_recorder import LossesRecorder  # noqa: E402
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint  # noqa: E402
from basetrainer.utils import log  # noqa: E402
from conftest import ToyTrainer, toy_cfg  # noqa: E402

# imported here, once, so that every forked child shares them (each costs about a second)
import torch._dynamo  # noqa: E402,F401  (the first optimizer imports it)

try:
    import matplotlib  # noqa: E402

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: E402,F401
    from torch.utils.tensorboard import SummaryWriter  # noqa: E402,F401
except ImportError:  # pragma: no cover
    pass


class Scripted(Callback):
    """Writes ``logs["test/metric"] = values[epoch]`` at each epoch end (before the checkpoint)."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def on_epoch_end(self, epoch, logs=None):
        logs["test/metric"] = self.values[epoch]


class Killer:
    """Counts write events; SIGKILLs this process at event ``kill_at``."""

    def __init__(self, kill_at, log_path):
        self.kill_at = kill_at
        self.count = 0
        self.log = open(log_path, "w") if log_path else None
        self._open, self._fsync, self._replace = builtins.open, os.fsync, os.replace
        self._link, self._remove = os.link, os.remove

    def event(self, kind, path=""):
        if self.log is not None:
            self.log.write(f"{self.count} {kind} {os.path.basename(str(path))}\n")
            self.log.flush()
        if self.count == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.count += 1

    def install(self):
        killer = self

        def open_(file, mode="r", *args, **kwargs):
            name = os.path.basename(str(file)) if isinstance(file, (str, bytes, os.PathLike)) else ""
            if "w" in str(mode) and name.startswith(".") and ".tmp" in name:
                killer.event("open", file)
            return killer._open(file, mode, *args, **kwargs)

        def fsync(fd):
            killer.event("fsync")
            return killer._fsync(fd)

        def replace(src, dst, *args, **kwargs):
            killer.event("replace", dst)
            result = killer._replace(src, dst, *args, **kwargs)
            killer.event("replaced", dst)
            return result

        def link(src, dst, *args, **kwargs):
            killer.event("link", dst)
            return killer._link(src, dst, *args, **kwargs)

        def remove(path, *args, **kwargs):
            killer.event("remove", path)
            return killer._remove(path, *args, **kwargs)

        builtins.open, os.fsync, os.replace, os.link, os.remove = open_, fsync, replace, link, remove


def train(case):
    """One toy training run described by ``case`` (a dict)."""
    torch.set_num_threads(1)
    work = case["work"]
    cfg = toy_cfg(num_epochs=case.get("epochs", 4), batch_size=16, n_train=64, n_test=16, lr=0.1, momentum=0.9,
                  work_dir=work, resume=case.get("resume", ""), log_freq=2)
    callbacks = [LossesRecorder(), Scripted(case["values"]),
                 LogHistory(log_dir=os.path.join(work, "log"), log_freq=2),
                 ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="test/metric", mode="min",
                                 start_save=case.get("start_save", -1), keep=case.get("keep", 2),
                                 async_save=case.get("async_save", False))]
    killer = Killer(case.get("kill_at", -1), case.get("events"))
    killer.install()
    log.set_logger(level="info", logfile=os.path.join(work, "log", "train.log"))
    t = ToyTrainer(cfg, callbacks=callbacks)
    t.run()
    torch.save({"model": t.unwrapped_model.state_dict(), "start_epoch": t.start_epoch},
               os.path.join(work, f"final{case.get('tag', '')}.pt"))


def start_case(case):
    """Fork a child that trains ``case``; returns its pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            train(case)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return pid


def exit_code(status):
    """A child's exit code; minus the signal's number when a signal ended it."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def run_cases(cases, parallel):
    """Every case's exit code, in order; up to ``parallel`` children at once (each case has its
    own work folder and counts its own write events, so they do not affect each other)."""
    codes = [None] * len(cases)
    running = {}
    for i, case in enumerate(cases):
        if len(running) >= parallel:
            pid, status = os.wait()
            codes[running.pop(pid)] = exit_code(status)
        running[start_case(case)] = i
    while running:
        pid, status = os.wait()
        codes[running.pop(pid)] = exit_code(status)
    return codes


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    # one torch thread per child: as many children as cores (2 on CI)
    print(json.dumps(run_cases(cases, max(1, min(4, os.cpu_count() or 1)))))
