"""Image-folder data sets (``root/<class>/<image>``) with clear errors for bad folders and files."""
import logging
import os
from typing import Any, Callable, List, Optional, Sequence, Union

from torch.utils.data import ConcatDataset, Dataset

from basetrainer.runtime.errors import ConfigError, PathError

logger = logging.getLogger(__name__)

_IMAGE_EXT = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _check_folder(root: str, key: str) -> List[str]:
    if not root:
        raise ConfigError(f"{key} is empty: set it to a folder of class subfolders (root/<class>/<image>)")
    if not os.path.isdir(root):
        raise PathError(f"{key}={root!r} does not exist or is not a folder: it must hold one "
                                f"subfolder of images per class")
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    if not classes:
        raise ConfigError(f"{key}={root!r} has no class subfolders: put the images in root/<class>/<image>")
    empty = [c for c in classes
             if not any(f.lower().endswith(_IMAGE_EXT) for _, _, files in os.walk(os.path.join(root, c))
                        for f in files)]
    if empty:
        raise ConfigError(f"{key}={root!r}: class folder(s) {empty} hold no images ({', '.join(_IMAGE_EXT)})")
    if len(classes) < 2:
        raise ConfigError(f"{key}={root!r} has only one class ({classes[0]!r}): a classifier needs at least "
                         f"two class subfolders")
    return classes


def load_image(path: str) -> Any:
    """Read an image as RGB; a damaged file (truncated, not an image) raises an error naming it."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise OSError(f"cannot read image {path!r} ({type(e).__name__}: {e}); replace or delete the file, "
                      f"or build the data set with image_folder(..., bad_images='skip')") from e


def _skip_bad(dataset: Any) -> None:
    """Drop the samples of ``dataset`` whose file cannot be read, with a warning per file."""
    good = []
    for path, target in dataset.samples:
        try:
            load_image(path)
        except OSError as e:
            logger.warning("skipping %s: %s", path, e.__cause__ or e)
            continue
        good.append((path, target))
    dataset.samples = dataset.imgs = good
    dataset.targets = [t for _, t in good]


def image_folder(root: Union[str, Sequence[str]], transform: Optional[Callable] = None, key: str = "train_data",
                 classes: Optional[List[str]] = None, bad_images: str = "raise") -> Dataset:
    """A torchvision ImageFolder (or several with the same classes, concatenated), checked first.

    The returned data set has ``.classes``. With ``classes`` given (the training classes), the
    folder must hold the same ones. A file that cannot be read (truncated, not an image) raises
    an error naming it when it is loaded; ``bad_images="skip"`` instead reads every image once
    here and leaves out the damaged ones, with a warning per file (slow on large data sets).

    Raises:
        FileNotFoundError / ValueError: missing folder, no class folders, an empty class, a
            single class, or classes that differ from ``classes``; the message names ``key``.
    """
    from torchvision.datasets import ImageFolder

    if bad_images not in ("raise", "skip"):
        raise ValueError(f"bad_images={bad_images!r} must be 'raise' (an error naming the file) or 'skip'")
    roots = [root] if isinstance(root, str) or root is None else list(root)
    if not roots:
        raise ConfigError(f"{key} is empty: set it to a folder of class subfolders")
    sets: List[Any] = []
    for r in roots:
        found = _check_folder(r, key)
        if classes is not None and found != list(classes):
            raise ConfigError(f"{key}={r!r} has classes {found}, but training uses {list(classes)}")
        if sets and found != sets[0].classes:
            raise ConfigError(f"{key}: folders {roots[0]!r} and {r!r} have different classes")
        sets.append(ImageFolder(r, transform=transform, loader=load_image))
        if bad_images == "skip":
            _skip_bad(sets[-1])
    if len(sets) == 1:
        return sets[0]
    dataset = ConcatDataset(sets)
    dataset.classes = sets[0].classes  # type: ignore[attr-defined]
    return dataset
