"""The stall watchdog: a rank that makes no progress for ``stall_timeout`` seconds ends the job
with a report that names where every rank is, instead of hanging until the backend's timeout.

Progress is :data:`PROGRESS`, a stamp of plain attributes (no lock, no torch op, no host sync):
the engine adds one to ``count`` at the end of every train step and test batch, the dispatcher
names the callback it is in (``where``), and :mod:`basetrainer.runtime.comm` marks the collective
it waits in (``collective``, with its per-process sequence number ``seq``) and counts its return.
There is one stamp per process because a stall is a process's: a collective helper has no
object to carry it, and the thread that watches must find it without being told.

:class:`Watchdog` is a daemon thread that reads the stamp once a second. When ``count`` has not
moved for ``timeout`` seconds, or another rank has announced a stall in the shared folder, it
writes (:mod:`basetrainer.runtime.stall_report`):

- ``stall-rank<k>.txt``: rank k's summary and the Python stack of every thread
  (``faulthandler.dump_traceback``);
- ``stall-rank<k>.json``: the summary (where the main thread is: its innermost frame in the
  user's code and in basetrainer, the collective and its sequence number, the callback);
- ``stall-report.txt`` (rank 0, after waiting up to ``gather`` seconds for the others'
  summaries): one line per rank and the rank(s) that differ; printed on stderr too.

Then the process ends with :data:`EXIT_STALL` (``os._exit``: the main thread is blocked, so no
exception could reach it), after a bounded wait for a background checkpoint write; a checkpoint
being written by the main thread is left as the previous file (every write is atomic).
"""
import faulthandler
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from basetrainer.runtime import crash_report, stall_report

logger = logging.getLogger(__name__)

#: the exit status of every process of a stalled job (2 is a user error, 128 + n a signal)
EXIT_STALL = 3
#: ``stall_timeout``'s default: far beyond any real step, epoch end or checkpoint write
DEFAULT_STALL_TIMEOUT = 1800.0
#: the process group's timeout exceeds ``stall_timeout`` by this much, so the watchdog speaks first
GROUP_MARGIN = 60.0
#: the file a stalled rank writes first, so that the other ranks report at once
TRIGGER = "stall-trigger"


class Progress:
    """Where this process is: written by the training thread, read by the watchdog."""

    __slots__ = ("count", "where", "collective", "seq", "steps", "batches")

    def __init__(self) -> None:
        self.count = 0            # train steps, test batches and collectives done
        self.where = ""           # "callback <Name>.<event>" while a callback runs, else ""
        self.collective = ""      # the comm collective waited in ("" when none)
        self.seq = 0              # comm collectives entered by this process
        self.steps = 0            # the engine's train steps done (forward, backward, optimizer step)
        self.batches = 0          # train batches done: more than steps when an override skipped one


#: this process's progress stamp
PROGRESS = Progress()
_RUNNING: List["Watchdog"] = []   # the watchdog watching this process (one at a time)


class collective:
    """``with collective("all_reduce"):`` marks the comm collective this process waits in."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        PROGRESS.seq += 1
        PROGRESS.collective = self.name

    def __exit__(self, *exc: Any) -> None:
        PROGRESS.collective = ""
        PROGRESS.count += 1


def check_timeout(value: Any) -> float:
    """``value`` as seconds (0 = off). Raises a ValueError/TypeError naming ``stall_timeout``."""
    from basetrainer.runtime.errors import ConfigError, ConfigTypeError

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"config key 'stall_timeout' = {value!r} ({type(value).__name__}) must be a number of "
                              f"seconds (default {DEFAULT_STALL_TIMEOUT:g}; 0 turns the stall watchdog off)")
    if not 0 <= value < float("inf"):
        raise ConfigError(f"config key 'stall_timeout' = {value!r} must be >= 0 and finite: seconds without "
                          f"progress before a stalled job is ended with a report (default "
                          f"{DEFAULT_STALL_TIMEOUT:g}; 0 turns the stall watchdog off)")
    return float(value)


def group_timeout(stall_timeout: Any) -> Optional[float]:
    """The process group's timeout for ``stall_timeout`` (None: off, the backend's own stays)."""
    seconds = check_timeout(stall_timeout)
    return seconds + GROUP_MARGIN if seconds > 0 else None


class Watchdog:
    """Watches :data:`PROGRESS` from a daemon thread while entered (``with Watchdog(...):``).

    Args:
        timeout: seconds without progress before the stall is reported; 0 starts no thread.
        folder: where the files go (``work_dir/log``), shared by the ranks of one machine.
        rank, world_size: this process's place in the job.
        gather: seconds rank 0 waits for the other ranks' summaries (the others wait for the
            report a little longer).
        exit: end the process with :data:`EXIT_STALL` after reporting (False: only report; tests).
    """

    def __init__(self, timeout: float, folder: str, rank: int = 0, world_size: int = 1, gather: float = 10.0,
                 exit: bool = True) -> None:
        self.timeout = check_timeout(timeout)
        self.folder, self.rank, self.world_size = folder, rank, world_size
        self.gather, self.exit = gather, exit
        self.poll = min(1.0, max(0.05, self.timeout / 10))
        self.thread: Optional[threading.Thread] = None
        self.fired: Optional[Dict[str, Any]] = None     # this rank's summary, once it reported
        self.reporting = False                           # a stall is being reported (the process then ends)
        self._stop = threading.Event()
        self._main = threading.get_ident()   # the thread that runs the loop (the one entering)
        self._started = 0.0
        self._fatal: Optional[crash_report.FatalStacks] = None

    def __enter__(self) -> "Watchdog":
        if _RUNNING:   # evaluate() inside run(): the run's watchdog watches
            return self
        _RUNNING.append(self)
        self._started = time.time()
        PROGRESS.steps = PROGRESS.batches = 0   # counted from here on every rank alike (a resume too)
        if self.world_size > 1:   # a rank aborted by a collective mismatch leaves its stacks (stall or not)
            self._fatal = crash_report.FatalStacks(self.folder, self.rank).__enter__()
        if self.timeout > 0:
            self.thread = threading.Thread(target=self._watch, name="basetrainer-stall-watchdog", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self._stop.set()
        if self in _RUNNING:
            _RUNNING.remove(self)
            if self.reporting and self.thread is not None:   # a stall: its report ends the process (exit 3)
                self.thread.join(timeout=self.gather + 30)
            elif exc is not None and self.world_size > 1 and crash_report.broken(exc):
                try:   # the job ends on this exception: first, where every rank was
                    crash_report.report_failure(exc, self.folder, self.rank, self.world_size, PROGRESS, self._started)
                except Exception as e:
                    logger.warning("rank %d: writing the failure report failed: %s: %s", self.rank, type(e).__name__, e)
        if self._fatal is not None:
            self._fatal.__exit__(exc_type, exc, tb)
            self._fatal = None
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
        self.thread = None

    # ----------------------------------------------------------------------------- the thread
    def _watch(self) -> None:
        try:
            self._watch_until_stalled()
        except Exception:   # a watchdog that died silently would leave the next stall unreported
            logger.exception("the stall watchdog of rank %d failed; stalls go unreported in this run", self.rank)

    def _watch_until_stalled(self) -> None:
        seen, since = PROGRESS.count, time.monotonic()
        trigger = os.path.join(self.folder, TRIGGER)
        while not self._stop.wait(self.poll):
            now = time.monotonic()
            if PROGRESS.count != seen:
                seen, since = PROGRESS.count, now
                continue
            if now - since >= self.timeout:
                self.report(now - since, announced_by=None)
                return
            # another rank's stall (a job of one process has none: a trigger there is another
            # process's, e.g. an evaluate() of the same work_dir, or a clock skewed file)
            by = announced(trigger, self._started) if self.world_size > 1 else None
            if by is not None:
                self.report(now - since, announced_by=by)
                return

    def report(self, idle: float, announced_by: Optional[int]) -> Dict[str, Any]:
        """Write this rank's files (rank 0: also the report), then exit unless ``exit`` is False."""
        self.reporting, summary = True, None
        try:
            summary = stall_report.summarize(self._main, self.rank, PROGRESS, idle, self.timeout, announced_by)
            os.makedirs(self.folder, exist_ok=True)
            if announced_by is None:
                stall_report.write_text(os.path.join(self.folder, TRIGGER), str(self.rank))
            if summary["waiting_for_data"]:   # the workers' own account of what they load
                summary["workers"] = stall_report.workers(self.folder, self.rank, summary["dataloader_workers"],
                                                          self._started, wait=3 * self.poll + 2)
            self.fired = summary
            stack = os.path.join(self.folder, f"stall-rank{self.rank}.txt")
            with open(stack, "w", encoding="utf-8") as f:
                f.write(stall_report.describe(summary) + "\n\nPython stacks of every thread (faulthandler; most "
                        "recent call first):\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            stall_report.write_text(os.path.join(self.folder, f"stall-rank{self.rank}.json"),
                                    json.dumps(summary, indent=1))
            report = os.path.join(self.folder, stall_report.REPORT)
            if self.rank == 0:
                text = stall_report.gather(self.folder, self.world_size, self._started, self.gather)
                stall_report.write_text(report, text)
                sys.stderr.write(text + "\n")
            else:
                _wait_for(report, self._started, self.gather + 5)
            why = (f"made no progress for {idle:.0f} s (stall_timeout {self.timeout:g} s)" if announced_by is None
                   else f"stops because rank {announced_by} stalled (no progress for stall_timeout {self.timeout:g} s)")
            sys.stderr.write(f"basetrainer: rank {self.rank} {why}: the job ends with exit status {EXIT_STALL}; "
                             f"see {report}\n")
            _wait_for_background_writes(10.0)
            _wait_for_file_write(self._main, 10.0)
        except Exception as e:   # the exit below must happen whatever went wrong here
            place = stall_report.describe(summary) + "\n" if summary else ""   # a full disk: on stderr at least
            sys.stderr.write(f"{place}basetrainer: rank {self.rank} stalled; writing the stall report failed: "
                             f"{type(e).__name__}: {e}\n")
        if self.exit:
            sys.stdout.flush()
            sys.stderr.flush()
            _end_children()
            if self._fatal is not None:   # no fatal signal: its crash file goes (os._exit skips __exit__)
                self._fatal.__exit__(None, None, None)
            os._exit(EXIT_STALL)
        return self.fired or {}


def announced(trigger: str, since: float) -> Optional[int]:
    """The rank that announced a stall of this job in ``trigger`` (written after ``since``)."""
    try:
        if os.stat(trigger).st_mtime < since - 1:
            return None
        with open(trigger, encoding="utf-8") as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return None


def _wait_for(path: str, since: float, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if os.stat(path).st_mtime >= since - 1:
                return
        except OSError:
            pass
        time.sleep(0.1)


def _wait_for_background_writes(seconds: float) -> None:
    """Let a checkpoint being written in the background finish (at most ``seconds``)."""
    from basetrainer.runtime import atomic

    done = threading.Thread(target=_quietly, args=(atomic.wait_for_writes,), daemon=True)
    done.start()
    done.join(seconds)


_ATOMIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "atomic.py")


def _wait_for_file_write(thread: int, seconds: float) -> None:
    """Let the thread ``thread`` finish the atomic write it is in, if any (at most ``seconds``;
    cut short, the temp file is left and the previous file stands)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread)
        while frame is not None and frame.f_code.co_filename != _ATOMIC:
            frame = frame.f_back
        if frame is None:
            return
        del frame
        time.sleep(0.05)


def _end_children() -> None:
    """Kill this process's own multiprocessing children (its DataLoader workers): a hung one
    never notices that its parent is gone, and ``os._exit`` skips multiprocessing's clean-up."""
    import multiprocessing

    for child in multiprocessing.active_children():
        try:
            child.kill()
        except OSError:
            pass


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:   # a failed write: the previous file stands (atomic); the stall is the news
        pass
