"""Exported files land whole or not at all.

Converters (torch's exporter, MNN's converter, pnnx, OpenVINO) write their files themselves,
often several at once and under names of their own. They write into a hidden staging folder
beside the final files; only a finished (and checked) export is moved to its final paths, one
file at a time through the runtime layer's atomic writer, the data file (``.bin``) before the
file that names it (``.param``, ``.xml``). A conversion that fails half-way leaves nothing at the
final paths (an older file there is left as it was) and its staging folder is removed; the
staging folder of an export that was killed is removed by the next export into that folder.
"""
import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
from typing import Iterator, List, Sequence

from basetrainer.runtime import atomic

logger = logging.getLogger(__name__)


_STAGING = re.compile(r"^\.export-tmp-(?P<host>.+)-(?P<pid>\d+)-[^-]+$")


class Staging:
    """A hidden folder beside the outputs, where converters write; see :func:`staging`.

    Its name holds the host and the process id, so the staging folders that killed exports left
    in ``folder`` (their process is gone) are removed when the next export there starts.
    """

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        remove_stale(folder)
        self.folder = tempfile.mkdtemp(prefix=f".export-tmp-{socket.gethostname()}-{os.getpid()}-", dir=folder)

    def path(self, name: str) -> str:
        """Where a converter writes the file ``name`` (a bare file name)."""
        return os.path.join(self.folder, os.path.basename(name))

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


@contextlib.contextmanager
def staging(folder: str) -> Iterator[Staging]:
    """A :class:`Staging` in ``folder`` (created), removed with everything in it at the end."""
    stage = Staging(folder or ".")
    try:
        yield stage
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


def size_of(paths: Sequence[str]) -> int:
    """Bytes on disk of the files of one export."""
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
