"""Preemption: SIGTERM/SIGINT stop training after the current step, with a resumable checkpoint.

Schedulers signal the whole process group (``scancel``, ``kill -- -PGID``, Ctrl-C), which
includes the DataLoader workers. Workers therefore ignore those signals (:class:`WorkerShield`)
and are shut down by their main process once it has saved; only a SIGTERM from the worker's own
parent (the DataLoader shutting it down) still ends a worker. The main process stops after the
current step (one process) or at the next step where all ranks compare flags (DDP), saves, and
exits with status 128 + the signal's number.
"""
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from torch.utils.data import DataLoader

from basetrainer.runtime import comm, crash_report

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A signal within this many seconds of the first is the same request delivered again, not a
# second Ctrl-C: ``timeout``, shells and launchers pass a signal on to the child *and* to its
# process group, so one request can arrive twice within milliseconds.
REPEAT_S = 1.0


def forces_stop(signum: int, first_at: float) -> bool:
    """Whether ``signum``, arriving after a first signal received at ``first_at``
    (``time.monotonic()``), is a second Ctrl-C that stops at once."""
    return signum == signal.SIGINT and time.monotonic() - first_at >= REPEAT_S


class Preemption:
    """Signal handlers of one ``run()``: a first SIGTERM/SIGINT asks to stop; a second Ctrl-C,
    a second or more later, stops at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.agreed = False     # every rank stops at this step (see stop_agreed)
        self._ranks = 1
        self._first_at = 0.0
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "Preemption":
        self.signum, self.agreed, self._ranks = None, False, comm.get_world_size()
        if threading.current_thread() is not threading.main_thread():
            return self

        def handler(signum: int, frame: Any) -> None:
            if self.signum is not None:
                if forces_stop(signum, self._first_at):
                    raise KeyboardInterrupt  # a second Ctrl-C stops at once
                return  # the first signal decides the exit status (a launcher passes it on too)
            self.signum, self._first_at = signum, time.monotonic()
            logger.warning("received signal %d: stopping after this step and saving a checkpoint", signum)

        for sig in _SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):  # not allowed here (e.g. embedded interpreters)
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stop_agreed(self, compare: bool) -> bool:
        """Whether the train loop stops after this step for a signal. One process: as soon as
        one came. DDP: every rank must stop at the same step, so the ranks compare flags where
        ``compare`` (every ``log_freq`` steps), and a signal that reached any rank stops them all."""
        if not self.agreed:
            if self._ranks == 1:
                self.agreed = self.signum is not None
            elif compare:
                self.agreed = comm.any_true(self.signum is not None)
        return self.agreed

    def exit(self, where: str, path: Optional[str], is_main: bool) -> None:
        """Tell how to resume and leave with status 128 + signal (every rank the same)."""
        signum = self.signum or signal.SIGTERM
        message = (f"training stopped by signal {signum} ({signal.Signals(signum).name}) at {where}; "
                   + (f"checkpoint saved to {path}; continue with resume: auto (or --resume {path})"
                      if path else "no checkpoint was saved (no work_dir and no ModelCheckpoint)"))
        if is_main:  # once: to the configured log (with none, logging's last resort writes it to stderr)
            logger.error("%s", message)
        raise SystemExit(128 + signum)


def start(loader: Any) -> Iterator[Any]:
    """``iter(loader)`` with SIGTERM/SIGINT blocked while it starts worker processes: a forked
    worker begins with them blocked, so every thread it ever runs has them blocked too and only
    its watcher (:func:`shield_worker`) receives them. A signal arriving meanwhile is delivered
    to this process right after."""
    forks = bool(getattr(loader, "num_workers", 0)) or not isinstance(loader, DataLoader)
    if forks:
        settle_threads()
        if comm.is_dist() and getattr(loader, "num_workers", 0):
            time.sleep(QUIET_S)   # the backend's threads finish the last collective (see QUIET_S)
    before = set(threading.enumerate()) if forks else set()
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        it = iter(loader)
    else:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(_SIGNALS))
        try:
            it = iter(loader)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    # kept for end_workers (weakly: a finished loop frees it); a DataLoader without workers has none
    if forks:
        try:
            ref = weakref.ref(it)
        except TypeError:   # an iterator that cannot be referred to weakly (a list's) has no workers
            return it
        _started[id(loader)] = ref
        feeders = [t for t in threading.enumerate() if t not in before and t.name == FEEDER]
        if feeders:
            _threads.append((ref, False, feeders))
    return it


# The threads that feed the worker processes of the iterators start() made (one per worker's
# queue, named by multiprocessing), joined before the next iterator forks its workers.
# A thread that is ending while os.fork runs can leave the forked worker deadlocked at birth for
# ever: CPython before 3.11.10 and 3.12.1 (gh-112275; Python 3.11.7 here) lets the child inherit
# the interpreter's thread-list lock that the ending thread holds. An iterator's feeder threads
# end when its workers are shut down (the loop ran out of batches, or end_workers) — just when
# the next loop forks its own (seen twice: predict()'s worker stuck in os.fork after evaluate()).
FEEDER = "QueueFeederThread"
# In a process group, the backend's own threads (gloo's run loops) may enter Python just after a
# collective returns (to free the Python side of its tensors), and entering makes a thread state
# under that same lock, without the GIL: a fork at that moment has the same fate. The loops fork
# right after a collective (predict() after its first all_gather, an epoch's loader after the
# epoch's figures), so start() first gives those threads this long, the GIL released. Seen: 1 hang
# in 34 runs of the generated ddp3 configs on 2 loaded cores with the threads above joined; 0 in
# about 30 since this pause (a mitigation measured by repetition, not a proof).
QUIET_S = 0.2
SETTLE_S = 2.0   # at most this long in all, for the threads of an iterator still in use elsewhere
_threads: List[Tuple[Any, bool, List[threading.Thread]]] = []   # (the iterator, its workers stopped, its feeders)


def settle_threads(timeout: float = SETTLE_S) -> None:
    """Join the feeder threads of the iterators :func:`start` made that are done: freed (its
    workers were shut down), or whose workers :func:`end_workers` stopped. An iterator still
    alive keeps its threads (its loop may still be reading, or its DataLoader reuses it:
    persistent workers). At most ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    keep = []
    for ref, stopped, threads in _threads:
        if ref() is not None and not stopped:
            keep.append((ref, stopped, threads))
            continue
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    _threads[:] = keep


# id(loader) -> its last iterator with workers, for end_workers (not kept on the loader, which
# may be pickled or be a user's wrapper)
_started: Dict[int, Any] = {}


def end_workers(*loaders: Any) -> None:
    """Stop the worker processes a run started through ``loaders`` now: a torch DataLoader's
    persistent iterator, and the iterator of a loop that raised (its traceback keeps it).

    Left to torch they stop when the iterator is freed, and a trainer's are freed by the garbage
    collector (the trainer lives in a reference cycle with its callbacks), which closes the
    iterator's queues first: each worker never gets its stop message and is waited for 5 s.
    The persistent iterator of a DataLoader inside a wrapper is left alone (that DataLoader
    reuses it). Never raises (a worker that does not stop is torch's to kill).
    """
    for loader in loaders:
        ref = _started.pop(id(loader), None)
        _stop_workers(loader, ref() if ref is not None else None)


def _stop_workers(loader: Any, last: Any) -> None:
    """Stop the worker processes of ``loader``'s persistent iterator and of ``last`` (the
    iterator :func:`start` made for it, if still alive), now; a persistent iterator of a
    DataLoader inside a wrapper is left alone.

    The one place that reaches into torch's DataLoader, because torch (2.14) has no public way
    to: an iterator stops its workers only when freed (``__del__`` calls its private
    ``_shutdown_workers``), too late here (see :func:`end_workers`); a DataLoader with
    ``persistent_workers`` keeps its iterator in the private ``_iterator`` and gives it to every
    later ``iter()``, so after stopping its workers that field is emptied for the next epoch to
    start new ones; and only the iterator says whether it is such a persistent one
    (``_persistent_workers``), when the DataLoader hides behind a user's wrapper.
    """
    own = loader._iterator if isinstance(loader, DataLoader) else None
    if last is not None and getattr(last, "_persistent_workers", False) and last is not own:
        last = None   # a wrapped DataLoader's: it starts its next epoch with it
    for it in {id(x): x for x in (own, last) if hasattr(x, "_shutdown_workers")}.values():
        try:
            it._shutdown_workers()
        except Exception as e:  # torch's shutdown is not meant to raise
            logger.warning("stopping the DataLoader workers failed: %s", e)
        # its feeder threads are ending now: joined before the next fork, persistent or not
        _threads[:] = [(ref, stopped or ref() is it, threads) for ref, stopped, threads in _threads]
    if own is not None:
        loader._iterator = None   # the next epoch (a later run()) starts new workers


def shield_worker() -> None:
    """In a DataLoader worker: ignore SIGINT, and SIGTERM unless its parent sends it.

    Blocked signals are taken by a watcher thread (``sigwaitinfo`` tells who sent them); a
    SIGTERM from the parent (the DataLoader shutting its workers down, or the interpreter's exit
    terminating daemonic children) ends the worker at once, as torch's own handler does.
    Without ``sigwaitinfo`` (macOS, Windows) the worker keeps torch's behaviour.
    """
    if not hasattr(signal, "sigwaitinfo") or not hasattr(signal, "pthread_sigmask"):
        return
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, set(_SIGNALS))

    def watch() -> None:
        while True:
            info = signal.sigwaitinfo(set(_SIGNALS))
            if info.si_signo == signal.SIGTERM and info.si_pid == parent:
                os._exit(0)

    threading.Thread(target=watch, name="basetrainer-worker-signals", daemon=True).start()


class WorkerShield:
    """A ``worker_init_fn`` that runs :func:`shield_worker`, then the user's own (picklable)."""

    def __init__(self, user_fn: Optional[Callable[[int], None]] = None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        shield_worker()
        crash_report.in_worker()   # a worker's fatal error is not its rank's
        if self.user_fn is not None:
            self.user_fn(worker_id)


def shield_loader(loader: Any) -> None:
    """Make ``loader``'s future worker processes ignore group signals (a no-op without workers;
    persistent workers already running keep their start, and :func:`end_workers` stops them)."""
    if getattr(loader, "num_workers", 0) <= 0:
        return
    init = getattr(loader, "worker_init_fn", None)
    if not isinstance(init, WorkerShield):
        loader.worker_init_fn = WorkerShield(init)
