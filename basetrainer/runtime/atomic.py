"""The one atomic writer: temp file, fsync, rename, folder fsync; and a background writer thread.

A crash at any point leaves either the old file or the new one, never a torn one. Temp files
are named ``.<name>.tmp-<host>-<pid>``, so the next run can tell the leftovers of a killed
writer (:func:`remove_stale_temps`) from a write in progress. A write that fails for lack of
space raises :class:`DiskFullError` naming the folder and the bytes needed.
"""
import errno
import logging
import os
import re
import shutil
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional

import torch

logger = logging.getLogger(__name__)

_TEMP = re.compile(r"^\..+\.tmp(?:-(?P<host>.+)-(?P<pid>\d+)|(?P<legacy_pid>\d+))$")


class DiskFullError(OSError):
    """A file could not be written for lack of space (``errno`` is ENOSPC)."""


def temp_path(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.tmp-{socket.gethostname()}-{os.getpid()}")


def atomic_save(content: Any, path: str) -> str:
    """:func:`write_atomically` after the background writes asked for before (files land in
    the order they were asked for)."""
    wait_for_writes()
    return write_atomically(content, path)


def write_atomically(content: Any, path: str, keep_previous: Optional[str] = None) -> str:
    """Write ``content`` to ``path`` atomically and durably; return ``path``.

    Args:
        content: ``bytes``, ``str`` (UTF-8), or anything ``torch.save`` writes.
        path: the file to (re)place.
        keep_previous: when given and ``path`` exists, the old file is renamed to this path
            just before the new one takes its place (so one of them always exists).

    Raises:
        DiskFullError: no space left; the message names the folder and the bytes needed, and
            ``path`` is untouched.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            if isinstance(content, str):
                f.write(content.encode("utf-8"))
            elif isinstance(content, (bytes, bytearray)):
                f.write(content)
            else:
                torch.save(content, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and os.path.exists(path):
            _keep(path, keep_previous)
        os.replace(tmp, path)
    except Exception as e:
        _remove_quietly(tmp)
        explained = _explain(e, path, content)
        if explained is e:
            raise
        raise explained from None   # one clear error: the folder, the bytes needed
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_folder(folder)
    return path


def _link_replace(source: str, path: str) -> None:
    """Make ``path`` a hard link to ``source``, replacing any old ``path`` atomically (OSError
    where links are impossible; nothing is left behind then)."""
    link = temp_path(path)
    try:
        _remove_quietly(link)
        os.link(source, link)
        os.replace(link, path)
    finally:
        _remove_quietly(link)   # also: rename() does nothing when both name one file already


def _keep(path: str, previous: str) -> None:
    """Make ``previous`` the current ``path`` (a hard link, so ``path`` never goes missing;
    a rename where links are impossible)."""
    try:
        _link_replace(path, previous)
    except OSError:
        os.replace(path, previous)


def link_atomically(source: str, path: str, content: Any = None) -> str:
    """Make ``path`` a hard link to ``source`` (no second copy of the bytes), replacing any
    old ``path`` atomically; where links are impossible, write ``content`` instead."""
    try:
        _link_replace(source, path)
    except OSError:
        if content is None:
            raise
        return write_atomically(content, path)
    fsync_folder(os.path.dirname(os.path.abspath(path)))
    return path


def fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be fsynced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def size_of(content: Any) -> int:
    """About how many bytes ``content`` takes on disk (its tensors' bytes)."""
    if isinstance(content, torch.Tensor):
        return content.numel() * content.element_size()
    if isinstance(content, (bytes, bytearray, str)):
        return len(content)
    if isinstance(content, dict):
        return sum(size_of(v) for v in content.values())
    if isinstance(content, (list, tuple)):
        return sum(size_of(v) for v in content)
    return 0


def human(n: Optional[float]) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def space_error(exc: BaseException) -> Optional[OSError]:
    """The ENOSPC/EDQUOT error behind ``exc`` (torch's zip writer hides it as the context of a
    RuntimeError "unexpected pos")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return exc
        for failure in (getattr(exc, "failures", None) or {}).values():   # DCP: each rank's error
            found = space_error(failure[0] if isinstance(failure, tuple) else failure)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


def _explain(exc: Exception, path: str, content: Any) -> Exception:
    folder = os.path.dirname(os.path.abspath(path))
    needed = size_of(content)
    try:
        free: Optional[int] = shutil.disk_usage(folder).free
    except OSError:
        free = None
    full = space_error(exc) is not None or (
        "unexpected pos" in str(exc) and free is not None and needed and free < needed)
    if not full:
        if hasattr(exc, "add_note") and f"while writing {path}" not in getattr(exc, "__notes__", []):
            exc.add_note(f"while writing {path}")
        return exc
    return DiskFullError(errno.ENOSPC, f"no space left in {folder}: writing {os.path.basename(path)} needs "
                                       f"about {human(needed)} and {human(free)} is free")


def stale_temps(folder: Optional[str]) -> List[str]:
    """The temp files in ``folder`` left by killed writers of this machine (their process is
    gone). Temp files of live processes or other hosts are not."""
    try:
        names = os.listdir(folder) if folder else []
    except OSError:
        return []
    host = socket.gethostname()
    found = []
    for name in names:
        match = _TEMP.match(name)
        if not match:
            continue
        pid = int(match.group("pid") or match.group("legacy_pid"))
        if match.group("host") in (None, host) and not pid_alive(pid):
            found.append(os.path.join(folder, name))
    return sorted(found)


def remove_stale_temps(folder: Optional[str]) -> List[str]:
    """Delete :func:`stale_temps` of ``folder``; return their paths."""
    removed = []
    for path in stale_temps(folder):
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    if removed:
        logger.info("removed %d temp file(s) of killed writes in %s", len(removed), folder)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine exists (this process counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fresh_name(path: str) -> str:
    """``path``, or ``path.2``, ``path.3``, ... : the first name no file has yet."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def set_aside(path: str, suffix: str) -> str:
    """Rename ``path`` to ``path + suffix`` (or :func:`fresh_name` of it, never over another
    file) and return the new path; the folder is fsynced."""
    dest = fresh_name(path + suffix)
    os.replace(path, dest)
    fsync_folder(os.path.dirname(path) or ".")
    return dest


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples, sets of tensors and plain values) whose tensors
    and containers no longer share memory with the live model, optimizer or callbacks, on the
    CPU (a background write of a callback's live set read it while training changed it)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach()
        return obj.clone() if obj.device.type == "cpu" else obj.to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(snapshot(v) for v in obj)
    if isinstance(obj, (set, frozenset, bytearray)):
        return type(obj)(obj)   # their items are immutable (hashable) or bytes
    return obj


class BackgroundWriter:
    """One thread that writes files while training goes on.

    At most one job is in flight: :meth:`submit` first waits for the previous one (memory stays
    bounded to one copy of the state, and a failed write is raised at the next save or at the
    end of training, with a note saying what was being written).
    """

    def __init__(self) -> None:
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> None:
        self.wait()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="basetrainer-ckpt")
            self._pending = self._executor.submit(job)

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


_WRITER = BackgroundWriter()
_IN_WRITER = threading.local()  # set in the writer thread: its own saves must not wait for it


def write_in_background(job: Callable[[], Any], what: str = "checkpoint") -> None:
    """Run ``job`` (which writes files from a :func:`snapshot`, with :func:`write_atomically`)
    in the writer thread, after the writes asked for before it. Returns at once."""
    def run() -> None:
        _IN_WRITER.active = True
        try:
            job()
        except Exception as e:
            if hasattr(e, "add_note") and not isinstance(e, DiskFullError):
                e.add_note(f"raised while writing {what} (in the background checkpoint writer)")
            raise

    _WRITER.submit(run)


def wait_for_writes() -> None:
    """Block until every background write has finished; re-raise a failed one."""
    if not getattr(_IN_WRITER, "active", False):
        _WRITER.wait()
