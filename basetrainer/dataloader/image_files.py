"""The images of a folder, unlabelled, in a fixed order: what ``predict`` runs a model over."""
import logging
import os
from typing import Any, Callable, List, Optional, Tuple

from torch.utils.data import Dataset

from basetrainer.runtime.errors import ConfigError, PathError

from basetrainer.dataloader.image_folder import _IMAGE_EXT, load_image

logger = logging.getLogger(__name__)


class ImageFiles(Dataset):
    """Every image under ``root`` (subfolders too, unless ``recursive=False``), sorted by path
    relative to ``root``; an item is ``(transform(image), index)``, and ``paths[index]`` its file.

    Hidden files and folders (``.DS_Store``, ``.ipynb_checkpoints``) are left out; any other file
    that is not an image is refused, naming it, before anything runs (a stray file is usually a
    mistake in the folder given). ``root`` may also be one image file.

    Args:
        root: a folder of images, or an image file.
        transform: applied to each RGB PIL image (e.g. the test transform).
        recursive: look in subfolders.
        key: the argument's name in error messages.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: a file that is not an image (named, with the extensions read), or no image.
    """

    def __init__(self, root: str, transform: Optional[Callable] = None, recursive: bool = True,
                 key: str = "predict") -> None:
        if not root or not os.path.exists(root):
            raise PathError(f"{key}={root!r} does not exist: give a folder of images or an image file")
        self.root, self.transform = root, transform
        if os.path.isfile(root):
            self.paths = [root]
            _check_image(root, key)
        else:
            self.paths = _scan(root, recursive, key)
        if not self.paths:
            raise ConfigError(f"{key}={root!r} holds no image ({', '.join(_IMAGE_EXT)})")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Tuple[Any, int]:
        image = load_image(self.paths[index])
        return (self.transform(image) if self.transform is not None else image), index

    def relative(self, index: int) -> str:
        """The file of sample ``index``, relative to ``root``."""
        return os.path.relpath(self.paths[index], self.root) if os.path.isdir(self.root) else self.paths[index]


def _check_image(path: str, key: str) -> None:
    if not path.lower().endswith(_IMAGE_EXT):
        raise ConfigError(f"{key}: {path!r} is not an image file (read: {', '.join(_IMAGE_EXT)}); move it out of the "
                         f"folder, or convert it")


def _scan(root: str, recursive: bool, key: str) -> List[str]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if recursive else []
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = os.path.join(folder, name)
            _check_image(path, key)
            found.append(path)
    return sorted(found, key=lambda p: os.path.relpath(p, root))
