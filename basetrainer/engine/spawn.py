"""Supervising the processes ``launch()`` spawns on one machine: wait for them, stop them all
when one fails, pass signals on, and leave no process of the job behind."""
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from basetrainer.engine import preemption
from basetrainer.runtime.processes import ProcessTree
from basetrainer.runtime.watchdog import EXIT_STALL

_PREEMPTED = (128 + signal.SIGTERM, 128 + signal.SIGINT)
STALL_GRACE = 30.0   # seconds the other ranks get to write their stall files once one rank exited stalled
# a rank ended by one of these (gloo aborts at a collective mismatch) leaves the others this long to
# fail in their collectives and write the failure report (basetrainer.runtime.crash_report)
_FATAL = tuple(-s for s in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL))
CRASH_GRACE = 10.0


def spawn(fn: Callable, nprocs: int, args: Tuple, grace: float = 120.0) -> None:
    """Start ``nprocs`` processes and wait for them; return when all succeeded.

    A rank that fails stops the others (SIGTERM, then SIGKILL after 10 s) and its error is
    raised. Preempted ranks (exit 128 + SIGTERM/SIGINT) are waited for, up to ``grace``
    seconds: they agree on a stop step, rank 0 saves, and every rank exits with that status,
    which is then this process's (SystemExit; 128 + the signal this process received, if it got
    one). A SIGTERM/SIGINT to this process is passed on to the ranks as SIGTERM (they may not
    share its process group; a rank keeps the first signal it saw); a second Ctrl-C stops all at
    once. A rank that ends stalled (exit :data:`~basetrainer.runtime.watchdog.EXIT_STALL`, after
    its stall report) lets the others end the same way for up to :data:`STALL_GRACE` seconds, and
    this process then exits with that status too (SystemExit); a rank ended by a fatal signal
    (gloo's abort at a collective mismatch) lets them fail and report for :data:`CRASH_GRACE`.
    When it returns or raises, no process of the job (DataLoader workers included) is left.
    """
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    procs = context.processes
    tree = ProcessTree(p.pid for p in procs)
    received: List[int] = []
    first_at = [0.0]

    def on_signal(signum: int, frame: Any) -> None:
        if received:
            if preemption.forces_stop(signum, first_at[0]):
                raise KeyboardInterrupt
            return   # the same request again (see preemption.REPEAT_S); the ranks have it
        received.append(signum)
        first_at[0] = time.monotonic()
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)  # ranks keep the first signal they saw

    previous = _install(on_signal)
    failed: Optional[int] = None
    kill_at = None
    try:
        while any(p.is_alive() for p in procs):
            multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
            tree.refresh()
            exited = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed is None and exited:
                failed = exited[0]
                preempted = procs[failed].exitcode in _PREEMPTED
                stalled = procs[failed].exitcode == EXIT_STALL   # the others write their stall files, then exit
                crashed = procs[failed].exitcode in _FATAL
                kill_at = time.monotonic() + (grace if preempted else STALL_GRACE if stalled
                                              else CRASH_GRACE if crashed else 0.0)
            if kill_at is not None and time.monotonic() >= kill_at:
                _stop(procs, tree)
                kill_at = None
    except BaseException:
        _stop(procs, tree)
        raise
    finally:
        _install(previous)
        tree.kill_remaining()
    if failed is None:
        return
    codes = [p.exitcode for p in procs]
    if codes[failed] in _PREEMPTED and all(c in _PREEMPTED for c in codes):
        raise SystemExit(128 + received[0] if received else codes[failed])   # this process's own signal
    if codes[failed] == EXIT_STALL:   # the ranks printed the report (rank 0) and where it is
        raise SystemExit(EXIT_STALL)
    _raise_failure(context, failed)


def _install(handlers: Any) -> Dict[int, Any]:
    """Install a handler (a function: for SIGTERM and SIGINT) or restore saved ones (a dict)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = handlers.get(sig) if isinstance(handlers, dict) else handlers
        if handler is not None:
            previous[sig] = signal.signal(sig, handler)
    return previous


def _stop(procs: List[Any], tree: ProcessTree) -> None:
    """SIGTERM the ranks still running, SIGKILL them after 10 s."""
    tree.refresh()
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            tree.refresh()
            p.kill()
            p.join()


def _raise_failure(context: Any, index: int) -> None:
    """Raise the failure of rank ``index`` the way torch.multiprocessing reports it."""
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    process = context.processes[index]
    error_file = context.error_files[index]
    if os.access(error_file, os.R_OK):
        with open(error_file, "rb") as f:
            trace = pickle.load(f)
        raise ProcessRaisedException(f"\n\n-- Process {index:d} terminated with the following error:\n{trace}",
                                     index, process.pid)
    code = process.exitcode
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"<Unknown signal {-code}>"
        raise ProcessExitedException(f"process {index:d} terminated with signal {name}", error_index=index,
                                     error_pid=process.pid, exit_code=code, signal_name=name)
    raise ProcessExitedException(f"process {index:d} terminated with exit code {code:d}", error_index=index,
                                 error_pid=process.pid, exit_code=code)
