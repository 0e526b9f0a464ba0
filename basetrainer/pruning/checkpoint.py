"""The pruned-model file: weights plus the layer shapes needed to rebuild the pruned network.

The file holds only tensors, numbers, strings, bools, lists and dicts, so it is read with
``torch.load(path, weights_only=True)`` and never unpickles a class::

    {"format": "basetrainer.pruned/1",
     "meta": {"prune_type": "l1", "sparsity": 0.5, "backend": "torch-pruning", ...},
     "shapes": {"layer1.0.conv1": {"type": "Conv2d", "in_channels": 32, ...}, ...},
     "state_dict": {"conv1.weight": tensor, ...}}

It is written by the one atomic writer (:mod:`basetrainer.runtime.atomic`), so a process that
polls for it (e.g. a non-zero rank waiting on rank 0) never reads half a file.
"""
import os
from pathlib import Path
from typing import Any, Dict, List, Union

import torch
from torch import nn

from basetrainer.pruning.shapes import layer_shapes, reshape_to
from basetrainer.runtime import atomic

PRUNED_FILENAME = "pruned_model.pth"
FILE_FORMAT = "basetrainer.pruned/1"

PathLike = Union[str, "os.PathLike[str]"]


def pruned_path(directory: PathLike) -> Path:
    """Where :func:`save_pruned` writes in ``directory``."""
    return Path(directory) / PRUNED_FILENAME


def save_pruned(model: nn.Module, directory: PathLike, meta: Dict[str, Any]) -> Path:
    """Write ``model``'s weights and layer shapes to ``directory/pruned_model.pth``.

    Args:
        model: The pruned model.
        directory: Output folder; created if missing.
        meta: Extra plain data to store (prune settings, sizes); no custom classes.

    Returns:
        The path written.
    """
    path = pruned_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FILE_FORMAT,
        "meta": dict(meta),
        "shapes": layer_shapes(model),
        "state_dict": {key: value.detach().cpu() for key, value in model.state_dict().items()},
    }
    atomic.write_atomically(payload, str(path))
    return path


def read_pruned(directory: PathLike) -> Dict[str, Any]:
    """Load the payload written by :func:`save_pruned` (``weights_only=True``, on the CPU).

    Raises:
        FileNotFoundError: There is no pruned file in ``directory``.
        ValueError: The file is not a pruned-model file of this format.
    """
    path = pruned_path(directory)
    if not path.is_file():
        raise FileNotFoundError(
            f"no pruned model at {str(path)!r}; run model_pruning once with reuse=False to create "
            "it (in distributed training: on rank 0, before the other ranks call it with reuse=True)")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FILE_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{str(path)!r} is not a pruned-model file of format {FILE_FORMAT!r} "
                         f"(found {found!r}); delete it and prune again with reuse=False")
    return payload


def load_pruned(model: nn.Module, payload: Dict[str, Any]) -> List[str]:
    """Reshape the dense ``model`` to the pruned shapes in ``payload`` and load its weights.

    Args:
        model: A dense model of the architecture that was pruned; modified in place.
        payload: What :func:`read_pruned` returned.

    Returns:
        The names of the layers that were replaced by smaller ones.

    Raises:
        ValueError: The model's architecture does not match the file.
    """
    replaced = reshape_to(model, payload["shapes"])
    try:
        model.load_state_dict(payload["state_dict"], strict=True)
    except RuntimeError as exc:
        raise ValueError(
            "the pruned weights do not fit this model after reshaping its layers; pass the same "
            "architecture the pruned file was made from, or prune again with reuse=False. "
            f"Details: {exc}") from exc
    return replaced
