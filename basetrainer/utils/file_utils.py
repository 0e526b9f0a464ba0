"""Small file helpers used by training scripts."""
import logging
import os
import shutil
from typing import Optional

logger = logging.getLogger(__name__)


def create_dir(path: str) -> str:
    """Create ``path`` (and its parents) if missing; return it."""
    if path:
        os.makedirs(path, exist_ok=True)
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
