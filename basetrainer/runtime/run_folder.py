"""The rules of a run folder: a new run never writes over the files of another one.

A run marks its checkpoint folder with :data:`MARKER` (its id and start time) when it starts.
A new run in a folder that holds another run's files is refused, unless it resumes that run or
``overwrite: true`` moves the old run aside (renamed to ``<folder>.old-<time>``, never deleted).
"""
import json
import logging
import os
import time
import uuid
from typing import Iterable, List, Optional

from basetrainer.runtime import atomic

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


def write_marker(folder: str, run_id: str) -> None:
    text = json.dumps({"run_id": run_id, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid()})
    atomic.write_atomically(text, os.path.join(folder, MARKER))


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
    """
    path = os.path.abspath(folder)
    here = os.path.abspath(os.getcwd())
    if here == path or here.startswith(path.rstrip(os.sep) + os.sep) or path in (os.path.expanduser("~"), os.sep):
        raise ValueError(f"overwrite: true would move {folder!r} aside, but it holds the current folder "
                         f"(or is the home or root folder); give the run a folder of its own (work_dir)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = f"{path}.old-{stamp}", 1
    while os.path.exists(dest):
        n += 1
        dest = f"{path}.old-{stamp}-{n}"
    os.rename(path, dest)
    atomic.fsync_folder(os.path.dirname(path))
    logger.warning("overwrite: true: moved the earlier run in %s to %s", folder, dest)
    return dest


def refusal(where: str, evidence: Iterable[str], what: str = "a new run") -> FileExistsError:
    shown = sorted(evidence)
    listed = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    return FileExistsError(
        f"{where} already holds the files of another run ({listed}); {what} there would mix with "
        f"them or replace them. Continue that run with resume: auto (--resume auto), give this run "
        f"another work_dir, or set overwrite: true (--overwrite) to move the old run aside to "
        f"<folder>.old-<time> and start afresh")
