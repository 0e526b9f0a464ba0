"""Images for the parity check and for int8 calibration, as the model saw them in training.

An ImageFolder (``root/<class>/<image>``) is read with the example's test transform: resize to
``[H, W]``, scale to [0, 1], normalise with ``mean``/``std`` (0.5 each, as examples/example.py
does; pass your training script's values). A subset of ``limit`` images is drawn with a fixed
seed, so two runs check the same images.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

DEFAULT_MEAN = (0.5, 0.5, 0.5)
DEFAULT_STD = (0.5, 0.5, 0.5)


@dataclass
class Images:
    """A batch of preprocessed images ``(N, C, H, W)`` and their class indices."""
    inputs: np.ndarray
    labels: Optional[np.ndarray]
    classes: List[str]
    source: str


def load_images(root: Union[str, Sequence[str]], input_size: Sequence[int], limit: Optional[int] = None,
                mean: Sequence[float] = DEFAULT_MEAN, std: Sequence[float] = DEFAULT_STD,
                channels: int = 3, seed: int = 0, key: str = "check") -> Images:
    """The images of the ImageFolder ``root`` (or several, with the same classes) at ``input_size`` ``[W, H]``.

    Raises:
        FileNotFoundError / ValueError: ``root`` is not an image folder (the message names ``key``);
            ``channels`` is neither 1 (read as grayscale) nor 3 (RGB).
    """
    from torchvision import transforms

    if channels not in (1, 3):
        raise ValueError(f"the model takes {channels} channels, and the images of a folder ({key}) are read as RGB "
                         f"(3 channels) or grayscale (1): pass {key} as an array (N, {channels}, H, W) of inputs "
                         f"preprocessed as in training")

    from basetrainer.dataloader.image_folder import image_folder

    w, h = (int(v) for v in input_size)
    steps = [transforms.Resize([h, w])]
    if channels == 1:
        steps.append(transforms.Grayscale(1))
    steps += [transforms.ToTensor(), transforms.Normalize(mean=list(mean)[:channels], std=list(std)[:channels])]
    dataset = image_folder(root, transform=transforms.Compose(steps), key=key)
    order = np.arange(len(dataset))
    if limit is not None and limit < len(order):
        order = np.sort(np.random.default_rng(seed).choice(order, size=int(limit), replace=False))
    images, labels = [], []
    for i in order:
        image, label = dataset[int(i)]
        images.append(image)
        labels.append(label)
    inputs = torch.stack(images).numpy().astype(np.float32)
    source = root if isinstance(root, str) else ", ".join(root)
    return Images(np.ascontiguousarray(inputs), np.asarray(labels, dtype=np.int64), list(dataset.classes), source)


def random_images(shape: Sequence[int], count: int = 16, seed: int = 0) -> Images:
    """Normal random inputs, for a check when no images are given (no labels)."""
    rng = np.random.default_rng(seed)
    return Images(rng.standard_normal((count, *shape[1:])).astype(np.float32), None, [], "random inputs")
