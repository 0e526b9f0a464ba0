"""When the ranks' collectives stop matching, the job ends at once rather than stalling, and the
report names the ranks as a stall's does (:mod:`basetrainer.runtime.stall_report`).

The usual way: one rank skips a step (an exception swallowed in ``train_step``) or runs a
collective the others do not. Its next collective then meets another one's message, gloo finds
the size wrong and aborts that process (SIGABRT, from C++: no Python code runs), and the other
ranks' collectives fail with "Connection reset by peer". Two writers make that legible:

- :class:`FatalStacks`: while a job of several ranks runs, faulthandler writes the Python stacks
  of every thread into ``crash-rank<k>.txt`` at a fatal signal (the file is removed when the
  rank ends any other way);
- :func:`report_failure`: a rank whose collective failed that way writes its summary from the
  exception's traceback (``stall-rank<k>.json``/``.txt``), and the lowest rank still alive
  gathers both kinds into ``stall-report.txt`` and prints it.
"""
import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Optional

from basetrainer.runtime import stall_report

#: what a failed collective's message says when a peer died, the connection broke or gloo/NCCL failed
_BROKEN = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo", "NCCL")


class FatalStacks:
    """``with FatalStacks(folder, rank):`` sends faulthandler's output at a fatal signal to
    ``folder/crash-rank<rank>.txt``, after a header naming the process and its main thread; on
    exit, faulthandler is as before and the file is gone. A folder that cannot be written to
    (a read-only finished run being evaluated) skips it."""

    def __init__(self, folder: str, rank: int) -> None:
        self.path = os.path.join(folder, f"crash-rank{rank}.txt")
        self.rank, self.file, self.was_enabled = rank, None, False

    def __enter__(self) -> "FatalStacks":
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.file = open(self.path, "w", encoding="utf-8")
            self.file.write(stall_report.CRASH_HEADER.format(rank=self.rank, pid=os.getpid(), host=socket.gethostname(),
                                                             thread=threading.get_ident()))
            self.file.flush()
        except OSError:
            self.file = None
            return self
        self.was_enabled = faulthandler.is_enabled()
        faulthandler.enable(file=self.file, all_threads=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.file is None:
            return
        faulthandler.disable()
        if self.was_enabled:
            faulthandler.enable(all_threads=True)   # on standard error, as Python's -X faulthandler does
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
    """Write this rank's summary of the failed collective ``exc``; the lowest rank still alive
    (every lower rank left a crash file) also writes and prints the report. Returns its path,
    or None when this rank does not write it."""
    tb = exc.__traceback__
    stack = (traceback.extract_stack(tb.tb_frame)[:-1] + traceback.extract_tb(tb)) if tb is not None else []
    entries = [(f.filename, f.lineno or 0, f.name) for f in stack]
    message = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    summary = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
               "failed": f"{type(exc).__name__}: {message[:300]}", "stall_timeout": 0, "progress": progress.count,
               "callback": progress.where, "collective": stall_report.comm_collective(entries), "seq": progress.seq,
               "dataloader_workers": [], **stall_report.frames(entries)}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"stall-rank{rank}.txt"), "w", encoding="utf-8") as f:
        f.write(stall_report.describe(summary) + "\n\n" + "".join(traceback.format_exception(exc)))
    stall_report.write_text(os.path.join(folder, f"stall-rank{rank}.json"), json.dumps(summary, indent=1))
    if any(stall_report.read_crash(folder, lower, since) is None for lower in range(rank)):
        return None   # a lower rank is alive: it reports
    dead = [r for r in range(world_size) if stall_report.read_crash(folder, r, since) is not None]
    title = (f"basetrainer failure report: the ranks' collectives failed ({world_size} ranks"
             + (f"; rank(s) {dead} ended on a fatal signal" if dead else "") + ")")
    text = stall_report.gather(folder, world_size, since, gather, title=title)
    path = os.path.join(folder, stall_report.REPORT)
    stall_report.write_text(path, text)
    sys.stderr.write(text + f"\nbasetrainer: rank {rank}'s collective failed; see {path}\n")
    return path
