"""The rules of a run folder: a new run never writes over the files of another one.

A run marks its checkpoint folder with :data:`MARKER` (its id and start time) when it starts.
A new run in a folder that holds another run's files is refused, unless it resumes that run or
``overwrite: true`` moves the old run aside (renamed to ``<folder>.old-<time>``, never deleted).
"""
import json
import logging
import os
import socket
import time
import uuid
from typing import Iterable, List, Optional

from basetrainer.runtime import atomic, processes
from basetrainer.runtime.errors import ConfigError, FolderError, RunBusyError, WorkDirError

logger = logging.getLogger(__name__)

MARKER = ".basetrainer-run.json"
CHECKPOINT_NAMES = ("last.pth", "last.prev.pth")


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def read_marker(folder: Optional[str]) -> Optional[dict]:
    if not folder:
        return None
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _started_at(pid: int) -> Optional[int]:
    """When ``pid`` started (tells it from a later process reusing the number), or None."""
    info = processes.stat(pid)
    return info[2] if info is not None else None


def write_marker(folder: str, run_id: str) -> None:
    """Mark ``folder`` as this process's run. The liveness check and the write are one step
    (under a lock on the folder): two runs started in the same instant both passed the check
    before either wrote, and both trained into the folder.

    Raises:
        RunBusyError (a RuntimeError): another process's run marked ``folder`` and is still training.
    """
    pid = os.getpid()
    text = json.dumps({"run_id": run_id, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": pid,
                       "host": socket.gethostname(), "pid_started": _started_at(pid)})
    try:
        import fcntl
        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):   # no flock (Windows) or no folder yet: the check alone
        fcntl, fd = None, -1
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        check_not_running(folder)
        atomic.write_atomically(text, os.path.join(folder, MARKER))
    finally:
        if fd >= 0:
            os.close(fd)   # releases the lock


def mark_ended(folder: str) -> None:
    """Note in ``folder``'s marker that this process's run has ended (its process may live on,
    e.g. a notebook's), so that another process may resume it."""
    marker = read_marker(folder)
    if marker and marker.get("pid") == os.getpid() and not marker.get("ended"):
        marker["ended"] = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            atomic.write_atomically(json.dumps(marker), os.path.join(folder, MARKER))
        except OSError as e:   # a full disk: the marker then still names this (soon ended) process
            logger.warning("could not note the end of the run in %s: %s", folder, e)


def running_elsewhere(marker: Optional[dict]) -> bool:
    """Whether the run that wrote ``marker`` is still alive in another process of this machine
    (markers of other hosts, or of 2.0 runs without a host, cannot be checked: False)."""
    if (not marker or marker.get("ended") or marker.get("host") != socket.gethostname()
            or not isinstance(marker.get("pid"), int)):
        return False
    pid = marker["pid"]
    if pid == os.getpid() or not atomic.pid_alive(pid):
        return False
    info = processes.stat(pid)   # None where /proc can't be read: the pid is then all we know
    if info is not None and info[0] in ("Z", "X"):   # exited, not yet reaped
        return False
    return marker.get("pid_started") is None or info is None or info[2] == marker["pid_started"]


def check_writable(folder: str, key: str = "work_dir", writes: bool = True) -> None:
    """Refuse, before anything is written, a ``folder`` that cannot be made or written: the
    nearest part of its path that exists must be a folder this user may write into (with
    ``writes=False``, only be a folder: a finished run kept read-only can still be evaluated).

    Raises:
        FolderError (an OSError): naming ``key``, the path and the part that stops it.
    """
    probe = os.path.abspath(folder)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) and probe == os.path.abspath(folder):
        raise FolderError(f"{key}={folder!r} is a file, not a folder; give {key} a folder path")
    if not os.path.isdir(probe):
        raise FolderError(f"{key}={folder!r} cannot be made: {probe} is a file, not a folder; "
                          f"give {key} a folder path")
    if writes and not os.access(probe, os.W_OK | os.X_OK):
        raise FolderError(f"{key}={folder!r} cannot be written: {probe} is read-only for this user "
                          f"(or on a read-only disk); give {key} a folder you can write")


def check_not_running(folder: Optional[str]) -> None:
    """Refuse to start in ``folder`` while the run that marked it is still training.

    Raises:
        RunBusyError (a RuntimeError): naming the run, its process and what to do.
    """
    marker = read_marker(folder)
    if running_elsewhere(marker):
        raise RunBusyError(
            f"{folder} belongs to run {marker.get('run_id')}, which is still training (process {marker['pid']} on "
            f"this machine, started {marker.get('started')}); two runs in one folder would overwrite each other's "
            f"checkpoints. Wait for it to end (or stop it: kill -TERM {marker['pid']} saves a checkpoint), then "
            f"resume: auto; or give this run another work_dir")


def check_none_running(evidence: Iterable[str]) -> None:
    """:func:`check_not_running` for the folder of every run marker in ``evidence`` (files
    :func:`find_runs` lists), before any of them is joined or moved aside."""
    for path in evidence:
        if os.path.basename(path) == MARKER:
            check_not_running(os.path.dirname(path))


def find_runs(root: Optional[str], depth: int = 3) -> List[str]:
    """Files that show a run used ``root``: ``last.pth``, ``last.prev.pth`` and run markers, at
    most ``depth`` folders below it."""
    found: List[str] = []
    if not root or not os.path.isdir(root):
        return found
    base = os.path.abspath(root).rstrip(os.sep).count(os.sep)
    for folder, dirs, files in os.walk(root):
        if os.path.abspath(folder).rstrip(os.sep).count(os.sep) - base >= depth:
            dirs[:] = []
        found += [os.path.join(folder, f) for f in files if f in CHECKPOINT_NAMES or f == MARKER]
    return sorted(found)


def move_aside(folder: str) -> str:
    """Rename ``folder`` to ``<folder>.old-<time>`` (a fresh name); return the new path.

    Raises:
        ValueError: ``folder`` holds the current working folder, or is the home or root folder.
        RuntimeError: a run that marked ``folder`` (or a folder below it) is still training.
    """
    check_none_running(find_runs(folder))   # a live run keeps writing to its path: never move it
    path = os.path.abspath(folder)
    here = os.path.abspath(os.getcwd())
    if here == path or here.startswith(path.rstrip(os.sep) + os.sep) or path in (os.path.expanduser("~"), os.sep):
        raise ConfigError(f"overwrite: true would move {folder!r} aside, but it holds the current folder "
                         f"(or is the home or root folder); give the run a folder of its own (work_dir)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = f"{path}.old-{stamp}", 1
    while os.path.exists(dest):
        n += 1
        dest = f"{path}.old-{stamp}-{n}"
    os.rename(path, dest)
    atomic.fsync_folder(os.path.dirname(path))
    _reopen_log_files(path)
    logger.warning("overwrite: true: moved the earlier run in %s to %s", folder, dest)
    return dest


def _reopen_log_files(folder: str) -> None:
    """Log files open inside ``folder`` (a script may open ``work_dir/log/train.log`` before it
    builds the trainer) followed the rename into the old run's folder: start each again at its
    path, so the new run logs into its own folder and not onto the old run's log."""
    prefix = folder.rstrip(os.sep) + os.sep
    seen = set()
    loggers = [logging.getLogger()] + [x for x in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(x, logging.Logger)]
    for handler in (h for x in loggers for h in x.handlers):
        if id(handler) in seen or not isinstance(handler, logging.FileHandler):
            continue
        seen.add(id(handler))
        if handler.stream is None or not handler.baseFilename.startswith(prefix):
            continue
        os.makedirs(os.path.dirname(handler.baseFilename), exist_ok=True)
        old = handler.setStream(handler._open())
        if old is not None:
            old.close()


def refusal(where: str, evidence: Iterable[str], what: str = "a new run") -> WorkDirError:
    shown = sorted(evidence)
    listed = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    return WorkDirError(
        f"{where} already holds the files of another run ({listed}); {what} there would mix with "
        f"them or replace them. Continue that run with resume: auto (--resume auto), give this run "
        f"another work_dir, or set overwrite: true (--overwrite) to move the old run aside to "
        f"<folder>.old-<time> and start afresh")
