"""The processes a training job starts, so that none outlives it.

A rank's DataLoader workers are its children; when the rank is killed they are re-parented and
may live on (a worker blocked in I/O never notices). :class:`ProcessTree` remembers every
descendant of the processes it watches (read from ``/proc``, so Linux only; elsewhere it knows
none), and kills the ones still running when the job is over.
"""
import logging
import os
import signal
import time
from typing import Dict, Iterable, List, Optional, Tuple

logger = logging.getLogger(__name__)


def stat(pid: int) -> Optional[Tuple[str, int, int]]:
    """``(state, parent pid, start time)`` of ``pid`` from /proc, or None if it is gone (or
    there is no /proc to read)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def running(pid: int, start: Optional[int] = None) -> bool:
    """``pid`` exists, is not a zombie, and (when ``start`` is given) is the same process."""
    info = stat(pid)
    if info is None:
        return False
    return info[0] != "Z" and (start is None or info[2] == start)


class ProcessTree:
    """Every descendant ever seen of ``roots`` (call :meth:`refresh` while the roots run)."""

    def __init__(self, roots: Iterable[int]) -> None:
        self.roots = list(roots)
        self.known: Dict[int, int] = {}  # pid -> start time (guards against a reused pid)

    def refresh(self) -> None:
        if not os.path.isdir("/proc"):
            return
        children: Dict[int, List[int]] = {}
        starts: Dict[int, int] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                info = stat(int(name))
                if info is not None:
                    children.setdefault(info[1], []).append(int(name))
                    starts[int(name)] = info[2]
        stack = self.roots + list(self.known)
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in self.known:
                    self.known[child] = starts[child]
                    stack.append(child)

    def kill_remaining(self, grace: float = 2.0, timeout: float = 10.0) -> List[int]:
        """Give the known descendants ``grace`` seconds to end by themselves, SIGKILL those still
        running, and wait until they are gone. Returns the killed ones."""
        deadline = time.monotonic() + grace
        while any(running(pid, start) for pid, start in self.known.items()) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = [pid for pid, start in self.known.items() if running(pid, start)]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while any(running(pid, self.known[pid]) for pid in left) and time.monotonic() < deadline:
            time.sleep(0.02)
        if left:
            logger.warning("killed %d leftover process(es) of the job (DataLoader workers?): %s", len(left), left)
        return left
