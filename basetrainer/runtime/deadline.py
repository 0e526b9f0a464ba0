"""Calls that may block without end (a network client's), run in order on one daemon thread, each
within a wall-clock deadline.

The caller gets the call's answer, its error, or :class:`DeadlineExceeded` once the call has run
``deadline`` seconds; it never waits longer. Python cannot end a thread, so a call past its
deadline is left to itself on the daemon thread (which never keeps the process from exiting),
and the worker takes no more calls. Calls may also be posted (the caller does not wait): the
failure of a posted call, or its overrun, is raised to the next caller.

Example::

    worker = Worker("mlflow", deadline=60)
    run = worker.call("starting the run", start)          # waits, at most 60 s once it runs
    worker.post("logging epoch 3", lambda: log(figures))  # queued, returns at once
    worker.call("ending the run", finish)                 # after the logs, in order
    worker.close()
"""
import collections
import threading
import time
from typing import Any, Callable, Deque, Optional


def check_seconds(value: Any, key: str, default: float) -> float:
    """``value`` as a positive, finite number of seconds.

    Raises:
        ValueError: naming ``key``, the value and the default.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{key}={value!r} must be a positive number of seconds (default {default:g})")
    return float(value)


class DeadlineExceeded(TimeoutError):
    """The call ``what`` ran ``deadline`` seconds without returning."""

    def __init__(self, what: str, deadline: float) -> None:
        super().__init__(f"{what} did not return within {deadline:g} s")
        self.what, self.deadline = what, deadline


class CallFailed(Exception):
    """The posted call ``what`` raised ``error`` (raised to the caller after it; ``__cause__`` is
    ``error``)."""

    def __init__(self, what: str, error: BaseException) -> None:
        super().__init__(f"{what} failed ({type(error).__name__}: {error})")
        self.what, self.error = what, error


class _Call:
    __slots__ = ("what", "fn", "posted", "done", "result", "error")

    def __init__(self, what: str, fn: Callable[[], Any], posted: bool) -> None:
        self.what, self.fn, self.posted = what, fn, posted
        self.done = False
        self.result: Any = None
        self.error: Optional[BaseException] = None


class Worker:
    """One daemon thread that runs the calls given to it in order, each within ``deadline`` seconds
    of its start.

    Args:
        name: the thread's name (seen in a stack dump).
        deadline: seconds one call may run.
        capacity: posted calls that may wait; a post to a full queue waits for room (at most
            until the running call's deadline).
    """

    def __init__(self, name: str, deadline: float, capacity: int = 256) -> None:
        self.name, self.deadline, self.capacity = name, float(deadline), capacity
        self._cond = threading.Condition()
        self._pending: Deque[_Call] = collections.deque()
        self._running: Optional[_Call] = None
        self._started = 0.0                          # when the running call began (monotonic)
        self._failure: Optional[Exception] = None   # raised to every later caller
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    # ------------------------------------------------------------------ the caller's side
    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` after the calls before it; return its answer or raise its error.

        Raises:
            DeadlineExceeded: ``fn`` or a call before it ran past the deadline.
            CallFailed: a posted call before it failed (``fn`` did not run).
        """
        item = self._submit(what, fn, posted=False)
        with self._cond:
            self._wait(lambda: item.done)
        if item.error is not None:
            raise item.error
        return item.result

    def post(self, what: str, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` and return (``what`` names it if it fails).

        Raises:
            DeadlineExceeded, CallFailed: an earlier call ran past the deadline or failed.
        """
        self._submit(what, fn, posted=True)

    def close(self) -> None:
        """The thread ends after the calls queued (it does not wait for them; an idle worker's
        thread is joined, so that no thread is ending when the program next forks: a fork at that
        moment can leave the child deadlocked on CPython < 3.11.10, gh-112275)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            idle = self._running is None and not self._pending
        if idle and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ inside
    def _submit(self, what: str, fn: Callable[[], Any], posted: bool) -> _Call:
        item = _Call(what, fn, posted)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"worker {self.name!r} is closed: {what} was not run")
            self._wait(lambda: len(self._pending) < self.capacity)
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return item

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Wait (the lock held) until ``ready()``; raise the worker's failure, or DeadlineExceeded
        once the running call has run past the deadline."""
        while True:
            if self._failure is not None:
                raise self._failure
            left = self.deadline
            if self._running is not None:
                left = self._started + self.deadline - time.monotonic()
                if left <= 0:
                    self._failure = DeadlineExceeded(self._running.what, self.deadline)
                    self._pending.clear()
                    continue
            if ready():
                return
            self._cond.wait(left)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed and self._failure is None:
                    self._cond.wait()
                if self._failure is not None or not self._pending:
                    return
                item = self._pending.popleft()
                self._running, self._started = item, time.monotonic()
                self._cond.notify_all()   # the callers' clocks start now
            try:
                item.result = item.fn()
            except Exception as e:
                item.error = e
            except BaseException as e:   # SystemExit in a library's thread: not the caller's exit
                item.error = RuntimeError(f"{type(e).__name__}: {e}")
            with self._cond:
                self._running = None
                item.done = True
                if self._failure is None and item.posted and item.error is not None:
                    self._failure = CallFailed(item.what, item.error)
                    self._failure.__cause__ = item.error
                    self._pending.clear()
                self._cond.notify_all()
