"""When the ranks' collectives stop matching, or a rank dies, the others' collectives fail at
once; the report then names the ranks as a stall's does (:mod:`basetrainer.runtime.stall_report`).

The usual way: one rank skips a step (an exception swallowed in ``train_step``) or runs a
collective the others do not. Its next collective then meets another one's message, gloo finds
the size wrong and aborts one process (SIGABRT, from C++: no Python code runs), and the other
ranks' collectives fail with "Connection reset by peer". Two writers make that legible:

- :class:`FatalStacks`: while a job of several ranks runs, faulthandler writes the Python stacks
  of every thread into ``crash-rank<k>.txt`` at a fatal signal (the file holds only a header
  naming the process until then, and is removed when the rank ends any other way: so it also
  tells whether the rank still runs, see :func:`basetrainer.runtime.stacks.alive`);
- :func:`report_failure`: a rank whose collective failed that way writes its summary from the
  exception's traceback (``stall-rank<k>.json``/``.txt``); the lowest rank still running
  gathers every rank's account into ``stall-report.txt`` and prints it.
"""
import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, List, Optional

from basetrainer.runtime import atomic, stacks, stall_report

#: what a failed collective's message says when a peer died or the connection broke (gloo's words)
_BROKEN = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
#: how long a rank whose collective failed waits for the lower ranks to end before it decides who reports
_LOWER_S = 3.0


_ACTIVE: List["FatalStacks"] = []   # the one that sends this process's faulthandler output to its crash file


def in_worker() -> None:
    """In a forked DataLoader worker: its own fatal error goes to standard error, not into its
    rank's crash file (which would then say that the rank died)."""
    if _ACTIVE:
        faulthandler.enable(all_threads=True)


class FatalStacks:
    """``with FatalStacks(folder, rank):`` sends faulthandler's output at a fatal signal to
    ``folder/crash-rank<rank>.txt``, after a header naming the process and its main thread; on
    exit, faulthandler is off again and the file is gone. A crash file of an earlier run with
    stacks in it is kept under another name (``crash-rank<k>.txt.<time>``); one with only the
    header (a rank killed without a trace) is replaced. Left alone: a process where faulthandler
    is already on (``-X faulthandler``, ``PYTHONFAULTHANDLER`` or the user's own ``enable``: its
    output goes where the user sent it; the file then holds only the header, which still tells
    whether the rank runs), and a folder that cannot be written to (a read-only finished run
    being evaluated)."""

    def __init__(self, folder: str, rank: int) -> None:
        self.path = os.path.join(folder, f"crash-rank{rank}.txt")
        self.rank, self.file = rank, None

    def __enter__(self) -> "FatalStacks":
        elsewhere = faulthandler.is_enabled()   # then the file only tells whether the rank runs
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            earlier = stacks.read_crash(os.path.dirname(self.path), self.rank, 0.0)
            if earlier is not None and earlier.get("crashed"):
                when = time.localtime(os.stat(self.path).st_mtime)
                atomic.set_aside(self.path, time.strftime(".%Y%m%d-%H%M%S", when))
            self.file = open(self.path, "w", encoding="utf-8")
            self.file.write(stacks.CRASH_HEADER.format(rank=self.rank, pid=os.getpid(), host=socket.gethostname(),
                                                       thread=threading.get_ident(),
                                                       elsewhere=stacks.ELSEWHERE if elsewhere else ""))
            self.file.flush()
        except OSError:
            self.file = None
            return self
        if not elsewhere:
            faulthandler.enable(file=self.file, all_threads=True)
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.file is None:
            return
        if self in _ACTIVE:
            faulthandler.disable()
            _ACTIVE.remove(self)
        self.file.close()
        self.file = None
        try:
            os.remove(self.path)
        except OSError:
            pass


def broken(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because a peer or the connection did."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(k in str(exc) for k in _BROKEN))


def report_failure(exc: BaseException, folder: str, rank: int, world_size: int, progress: Any, since: float,
                   gather: float = 5.0) -> Optional[str]:
    """Write this rank's summary of the failed collective ``exc``; the lowest rank still running
    also prints and writes the report. Returns its path, or None when this rank does not write it."""
    tb = exc.__traceback__
    stack = (traceback.extract_stack(tb.tb_frame)[:-1] + traceback.extract_tb(tb)) if tb is not None else []
    entries = [(f.filename, f.lineno or 0, f.name) for f in stack]
    message = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    summary = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
               "failed": f"{type(exc).__name__}: {message[:300]}", "stall_timeout": 0, "progress": progress.count,
               "steps": progress.steps, "batches": progress.batches, "callback": progress.where,
               "collective": stacks.comm_collective(entries), "seq": progress.seq, "dataloader_workers": [],
               **stacks.frames(entries)}
    deadline = time.monotonic() + _LOWER_S   # a lower rank may be failing too, a moment later: it reports
    while (lower_runs := any(stacks.alive(folder, lower, since) for lower in range(rank))) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    reports = not lower_runs
    path, unwritten = os.path.join(folder, stall_report.REPORT), None
    try:
        os.makedirs(folder, exist_ok=True)
        stall_report.write_text(os.path.join(folder, f"stall-rank{rank}.txt"),
                                stall_report.describe(summary) + "\n\n" + "".join(traceback.format_exception(exc)))
        stall_report.write_text(os.path.join(folder, f"stall-rank{rank}.json"), json.dumps(summary, indent=1))
    except OSError as e:   # a full disk, a read-only folder: what this rank knows goes to stderr
        unwritten = e
    if not reports:
        if unwritten is not None:
            sys.stderr.write(f"{stall_report.describe(summary)}\nbasetrainer: rank {rank}: its summary could not be "
                             f"written to {folder}: {unwritten}\n")
        return None
    dead = [r for r in range(world_size) if (s := stacks.read_crash(folder, r, since)) and s.get("crashed")]
    title = (f"basetrainer failure report: the ranks' collectives failed ({world_size} ranks"
             + (f"; rank(s) {dead} ended on a fatal signal" if dead else "") + ")")
    text = stall_report.gather(folder, world_size, since, gather, title=title, known={rank: summary},
                               no_summary="it ended through Python, an exception or an exit whose traceback the "
                                          "launcher shows, or it runs on another machine")
    sys.stderr.write(text + "\n")
    try:
        stall_report.write_text(path, text)
    except OSError as e:
        sys.stderr.write(f"basetrainer: rank {rank}: the failure report above could not be written to {path}: {e}\n")
        return None
    sys.stderr.write(f"basetrainer: rank {rank}'s collective failed; see {path}\n")
    return path
