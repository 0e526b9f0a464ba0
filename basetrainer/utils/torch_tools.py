"""Seeding and loading weights."""
import logging
import os
import random
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from basetrainer.runtime import checkpoint
from basetrainer.runtime.modules import unwrap_model

logger = logging.getLogger(__name__)

DEFAULT_SEED = 2020


def set_env_random_seed(seed: int = DEFAULT_SEED, deterministic: bool = False) -> int:
    """Seed python, numpy and torch (all devices) so runs are repeatable.

    Args:
        seed: the seed.
        deterministic: also ask cuDNN for deterministic kernels (slower).

    Returns:
        The seed.
    """
    import numpy as np

    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r} must be an integer")
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return seed


def load_state_dict(model_path: str, map_location: Any = "cpu") -> Dict[str, torch.Tensor]:
    """The model weights in ``model_path`` (a state_dict or a basetrainer checkpoint), loaded
    with ``weights_only=True`` and without a ``module.`` prefix.

    Raises:
        FileNotFoundError: no such file.
        ValueError: truncated, not a torch file, pickled code, or no state_dict inside.
    """
    obj = checkpoint.load_file(model_path, map_location=map_location)
    return checkpoint.extract_state_dict(obj, source=f"file {model_path!r}")


def load_weights(model: nn.Module, state_dict: Union[str, Dict[str, torch.Tensor]], strict: bool = True,
                 source: Optional[str] = None, skip_mismatched: bool = False) -> nn.Module:
    """Load weights into ``model`` (unwrapped first), with an error that names what differs.

    Args:
        model: the module (DataParallel/DDP wrappers are looked through).
        state_dict: weights, or a path to a file holding them.
        strict: every key must match (missing and unexpected keys are an error).
        source: a name for the weights in messages (the file).
        skip_mismatched: leave out tensors whose shape differs (a warning names them) instead
            of failing; with ``strict=False`` missing/unexpected keys are only warned about.

    Raises:
        ValueError: keys or shapes do not match; the message lists the missing, unexpected and
            mismatched keys (weights for another architecture, usually).
    """
    if isinstance(state_dict, str):
        source = source or state_dict
        state_dict = load_state_dict(state_dict)
    source = source or "state_dict"
    model = unwrap_model(model)
    own = model.state_dict()
    state_dict = checkpoint.extract_state_dict(state_dict, source=source)
    mismatched = [f"{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in state_dict.items() if k in own and own[k].shape != v.shape]
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]

    def _short(keys: list) -> str:
        return ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")

    if (strict and (missing or unexpected)) or (mismatched and not skip_mismatched):
        parts = []
        if missing:
            parts.append(f"missing keys: {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_short(unexpected)}")
        if mismatched:
            parts.append(f"shape mismatch: {_short(mismatched)}")
        raise ValueError(f"weights in {source} do not fit {type(model).__name__} "
                         f"(another architecture or number of classes?): " + "; ".join(parts))
    if mismatched:
        logger.warning("%s: skipped tensors of another shape: %s", source, _short(mismatched))
        state_dict = {k: v for k, v in state_dict.items() if not (k in own and own[k].shape != v.shape)}
    if missing or unexpected:
        logger.warning("%s: loaded non-strictly; missing keys: %s; unexpected keys: %s", source,
                       _short(missing) or "none", _short(unexpected) or "none")
    model.load_state_dict(state_dict, strict=False)
    return model
