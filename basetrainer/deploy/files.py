"""Exported files land whole or not at all, and a full disk is one clear error.

Converters (torch's exporter, MNN's converter, pnnx, OpenVINO) write their files themselves,
often several at once and under names of their own. They write into a hidden staging folder
beside the final files; only a finished (and checked) export is moved to its final paths, one
file at a time through the runtime layer's atomic writer, the data file (``.bin``) before the
file that names it (``.param``, ``.xml``). A conversion that fails half-way leaves nothing at the
final paths (an older file there is left as it was) and its staging folder is removed; the
staging folder of an export that was killed is removed by the next export into that folder.

A full disk, one way for every converter: each conversion writes into a folder of its own inside
the staging folder (:meth:`Staging.attempt`). When it fails (an exception, or files that do not
load or disagree with the model), the disk is judged before anything of it is removed: an
ENOSPC/EDQUOT behind the error, "No space left on device" in a converter's output, or less than
:data:`SPACE_MARGIN` free on the disk with no room left at all (:data:`FULL_LEFT`), less than the
weights, or less than half of what was free when the conversion started (a converter that writes
a short file and reports success, as MNN's does, or fails with a stream error, as OpenVINO's
does, leaves the disk full behind it; one that fails for another reason on a small disk leaves
its room).
Then the failure is one :class:`~basetrainer.runtime.atomic.DiskFullError` naming the output
folder. Either way the conversion's folder is removed, so the space it took is free again for
the next format. Nothing that can abort the process writes to the disk here: the converters
that are programs of their own (pnnx, MNN's) run in child processes, and torch's zip writer,
which aborts the process when the disk fills up under it, writes to memory first.
"""
import contextlib
import errno
import logging
import os
import re
import shutil
import socket
import tempfile
from typing import Iterator, List, Optional, Sequence

from basetrainer.runtime import atomic

logger = logging.getLogger(__name__)


_STAGING = re.compile(r"^\.export-tmp-(?P<host>.+)-(?P<pid>\d+)-[^-]+$")

SPACE_MARGIN = 1 << 20   # bytes: a conversion that failed with less than this free may have run out of space
FULL_LEFT = 64 << 10     # bytes: what a writer that ran out of space leaves free (a few blocks), at most


class Staging:
    """A hidden folder beside the outputs, where converters write; see :func:`staging`.

    Its name holds the host and the process id, so the staging folders that killed exports left
    in ``folder`` (their process is gone) are removed when the next export there starts.
    """

    def __init__(self, folder: str, inside: Optional["Staging"] = None) -> None:
        self.out_dir = inside.out_dir if inside else folder
        self.what, self.needed, self.before = "the export", 0, None   # what attempt() writes here
        try:
            if inside:   # a conversion's own folder (see attempt)
                self.folder = tempfile.mkdtemp(prefix="part-", dir=inside.folder)
                return
            os.makedirs(folder, exist_ok=True)
            remove_stale(folder)
            self.folder = tempfile.mkdtemp(prefix=f".export-tmp-{socket.gethostname()}-{os.getpid()}-", dir=folder)
        except OSError as e:
            if atomic.space_error(e) is None:
                raise
            raise atomic.DiskFullError(errno.ENOSPC, f"no space left in {self.out_dir}: not even a staging folder "
                                                     f"could be made there; free space or pass another "
                                                     f"out_dir") from None

    def path(self, name: str) -> str:
        """Where a converter writes the file ``name`` (a bare file name)."""
        return os.path.join(self.folder, os.path.basename(name))

    @contextlib.contextmanager
    def attempt(self, what: str, needed: int = 0, keep: bool = False) -> Iterator["Staging"]:
        """A folder of its own inside this one for one conversion (``what``: "the mnn files");
        removed when the block ends (kept after success with ``keep``). A failure in the block
        that comes from a full disk (see :meth:`space_error`) is raised as one DiskFullError.

        Args:
            what: the files the block writes, for the message.
            needed: bytes they take at least (the model's weights), for the message.
            keep: keep the folder after the block succeeds (a file the next conversions read).
        """
        part = Staging(self.folder, inside=self)
        part.what, part.needed, part.before = what, needed, free_bytes(part.folder)
        try:
            yield part
        except Exception as e:
            full = part.space_error(e)   # judged before its files go
            shutil.rmtree(part.folder, ignore_errors=True)
            if full is not None and full is not e:
                raise full from e
            raise
        except BaseException:
            shutil.rmtree(part.folder, ignore_errors=True)
            raise
        if not keep:
            shutil.rmtree(part.folder, ignore_errors=True)

    def space_error(self, error: Optional[BaseException] = None) -> Optional[atomic.DiskFullError]:
        """The DiskFullError to raise for the conversion into this folder that failed with
        ``error`` (or, without one, wrote files that load but disagree with the model), when
        the disk is why: an ENOSPC/EDQUOT behind ``error``, "No space left on device" in its
        text (a converter's output), a short write (torch's words for it) with less free now
        than the weights take, or less than :data:`SPACE_MARGIN` free now with no room left
        (:data:`FULL_LEFT`), less than the weights, or less than half of what was free when this
        conversion started. None when the disk is not why;
        ``error`` itself when it already is one."""
        if isinstance(error, atomic.DiskFullError):
            return error
        now = free_bytes(self.folder)
        text = _text(error) if error is not None else ""
        cause = atomic.space_error(error) if error is not None else None
        # filled: under SPACE_MARGIN free now, and no room left at all (a writer that ran out
        # leaves a few blocks), or less than the weights, or this conversion took at least half of
        # what was free when it started. A failure for another reason on a small disk with room
        # left is that failure: 990 KB free after 14 KB of int8 files that disagreed is no full disk
        filled = now is not None and now < SPACE_MARGIN and (
            now < FULL_LEFT or now < self.needed or self.before is None or now < self.before / 2)
        full = (cause is not None or "No space left on device" in text or filled
                # a short write without an errno (torch's writers), whose partial file its writer
                # removed again: then the disk holds less than the weights
                or (any(s in text for s in _SHORT_WRITE) and now is not None and now < max(self.needed, SPACE_MARGIN)))
        if not full:
            return None
        folder = self.out_dir
        if cause is not None and isinstance(cause.filename, str) and not _inside(cause.filename, self.out_dir):
            folder = os.path.dirname(os.path.abspath(cause.filename))   # a converter's temporary folder (/tmp)
        weights = f"; the model's weights alone take {atomic.human(self.needed)}" if self.needed else ""
        return atomic.DiskFullError(errno.ENOSPC, f"no space left in {folder}: writing {self.what} filled the disk "
                                                  f"({atomic.human(self.before)} was free in {self.out_dir} when it "
                                                  f"started{weights}); free space or pass another out_dir")

    def publish(self, pairs: Sequence[tuple]) -> List[str]:
        """Move each ``(staged, final)`` file to its final path, in the order given; if one
        fails, the finals of this call that did not exist before are removed again."""
        for staged, final in pairs:
            if not os.path.isfile(staged) or os.path.getsize(staged) == 0:
                raise RuntimeError(f"the converter wrote no {os.path.basename(final)} (expected {staged}); "
                                   f"see the converter's output above")
        new: List[str] = []
        try:
            for staged, final in pairs:
                existed = os.path.exists(final)
                publish_file(staged, final)
                if not existed:
                    new.append(final)
        except BaseException:
            for final in new:
                _remove(final)
            raise
        return [final for _, final in pairs]

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


_SHORT_WRITE = ("requested and", "unexpected pos")


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _text(error: BaseException) -> str:
    """``error``'s message and those of the errors it was raised from."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(str(error))
        error = error.__cause__ or error.__context__
    return " | ".join(parts)


@contextlib.contextmanager
def staging(folder: str, what: str = "the export") -> Iterator[Staging]:
    """A :class:`Staging` in ``folder`` (created), removed with everything in it at the end; a
    failure in the block that comes from a full disk is one DiskFullError naming ``folder``."""
    stage = Staging(folder or ".")
    try:
        with stage.attempt(what) as part:
            yield part
    finally:
        stage.close()


def remove_stale(folder: str) -> List[str]:
    """Remove the staging folders in ``folder`` of exports of this machine whose process is gone."""
    removed = []
    host = socket.gethostname()
    for name in os.listdir(folder):
        match = _STAGING.match(name)
        if match and match.group("host") == host and not atomic.pid_alive(int(match.group("pid"))):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            removed.append(name)
    if removed:
        logger.info("removed %d staging folder(s) of killed exports in %s", len(removed), folder)
    return removed


def publish_file(staged: str, final: str) -> str:
    """Make ``final`` the file ``staged`` atomically (a hard link; where links are impossible,
    a copy written by the atomic writer)."""
    os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
    try:
        atomic.link_atomically(staged, final)
    except OSError:
        with open(staged, "rb") as f:
            atomic.write_atomically(f.read(), final)
    return final


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def free_bytes(folder: str) -> Optional[int]:
    """Bytes this process may still write on ``folder``'s disk (root may use the blocks
    reserved for it), or None when it cannot be told."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):   # AttributeError: no statvfs (Windows)
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            return None
    root = getattr(os, "geteuid", lambda: -1)() == 0
    return (st.f_bfree if root else st.f_bavail) * st.f_frsize


def size_of(paths: Sequence[str]) -> int:
    """Bytes on disk of the files of one export."""
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
