"""Small file helpers used by training scripts."""
import logging
import os
import shutil
from typing import Optional

logger = logging.getLogger(__name__)


def create_dir(path: str) -> str:
    """Create ``path`` (and its parents) if missing; return it.

    Raises:
        FolderError (an OSError and a user error): a file stands where a folder of the path must be.
    """
    if path:
        try:
            os.makedirs(path, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            from basetrainer.runtime.errors import FolderError

            blocker = os.path.abspath(path)   # the part of the path that is a file
            while os.path.dirname(blocker) != blocker and not (os.path.exists(blocker) and not os.path.isdir(blocker)):
                blocker = os.path.dirname(blocker)
            raise FolderError(f"cannot make the folder {path!r}: {blocker} is a file, not a folder; remove or "
                              f"rename it, or give work_dir another folder") from None
    return path


def copy_file_to_dir(file: Optional[str], dir: str) -> Optional[str]:
    """Copy ``file`` into folder ``dir`` (created if needed); return the copy's path.

    A ``file`` of None or "" (a config given only by command-line flags) copies nothing.
    """
    if not file:
        logger.debug("copy_file_to_dir: no file given, nothing copied")
        return None
    if not os.path.isfile(file):
        raise FileNotFoundError(f"copy_file_to_dir: {file!r} does not exist")
    create_dir(dir)
    dest = os.path.join(dir, os.path.basename(file))
    if os.path.abspath(dest) != os.path.abspath(file):
        shutil.copyfile(file, dest)
    return dest
