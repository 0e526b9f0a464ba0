"""The model zoo: any torchvision classification model by name, sized for the task.

Pretrained weights are never downloaded during training: they come from torch's hub cache
(``<torch hub dir>/checkpoints/<file>``) or from a path; when they can't be had, one warning names
the file to place and where, and the model trains from scratch.
"""
import logging
import os
from typing import Any, List, Optional, Sequence, Union

import torch
from torch import nn

from basetrainer.runtime.errors import ConfigError

logger = logging.getLogger(__name__)

SMALL_INPUT = 64  # inputs up to this size keep more resolution: the first conv gets stride 1


def model_names() -> List[str]:
    """Names of the torchvision classification models ``get_models`` accepts."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def _check_input_size(input_size: Any) -> List[int]:
    if (not isinstance(input_size, (list, tuple)) or len(input_size) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in input_size)):
        raise ConfigError(f"input_size={input_size!r} must be two positive integers [W, H], e.g. [224, 224]")
    return list(input_size)


def _last_linear(model: nn.Module) -> Optional[str]:
    name = None
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            name = n
    return name


def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """Replace the model's last ``nn.Linear`` by one with ``num_classes`` outputs."""
    name = _last_linear(model)
    if name is None:
        raise ValueError(f"{type(model).__name__} has no nn.Linear classifier head to resize")
    old = model.get_submodule(name)
    if old.out_features == num_classes:
        return model
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, nn.Linear(old.in_features, num_classes, bias=old.bias is not None))
    return model


def adapt_stem(model: nn.Module) -> nn.Module:
    """Give the first convolution stride 1, so small images (e.g. 32x32) keep their detail.

    Only the stride changes: pretrained stem weights still fit.
    """
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.stride = (1, 1)
            break
    return model


def hub_weights_file(net_type: str) -> Optional[str]:
    """Where torchvision's default weights for ``net_type`` are cached (None if it has none)."""
    import torchvision

    try:
        weights = torchvision.models.get_model_weights(net_type).DEFAULT
    except (ValueError, KeyError, AttributeError):
        return None
    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))


def _load_pretrained(model: nn.Module, net_type: str, pretrained: Union[bool, str]) -> bool:
    """Load weights into ``model`` (before its head is resized); False when none could be had."""
    from basetrainer.utils import torch_tools

    if isinstance(pretrained, str):  # a file: load what fits, say what does not
        state = torch_tools.load_state_dict(pretrained)
        torch_tools.load_weights(model, state, strict=False, source=pretrained, skip_mismatched=True)
        return True
    path = hub_weights_file(net_type)
    if path is None:
        logger.warning("pretrained=True: torchvision has no pretrained weights for %r; training from scratch",
                       net_type)
        return False
    if not os.path.isfile(path):
        logger.warning("pretrained weights for %s are not available offline; to use them place %s in %s "
                       "(or set pretrained to a weights file). Training from scratch.",
                       net_type, os.path.basename(path), os.path.dirname(path))
        return False
    state = torch_tools.load_state_dict(path)
    torch_tools.load_weights(model, state, strict=True, source=path)
    return True


def get_models(net_type: str, input_size: Sequence[int] = (224, 224), num_classes: int = 1000,
               pretrained: Union[bool, str] = False, **kwargs: Any) -> nn.Module:
    """Build a torchvision classification model with ``num_classes`` outputs.

    Args:
        net_type: any torchvision classification model (resnet18/34/50/101, mobilenet_v2,
            mobilenet_v3_small/large, efficientnet_b0, ...); see :func:`model_names`.
        input_size: ``[W, H]``; up to 64 pixels, the first convolution gets stride 1.
        num_classes: outputs of the new head.
        pretrained: ``True`` for torchvision's weights from the local hub cache, or a path to a
            weights file (a state_dict or a checkpoint holding one).
        **kwargs: passed to the torchvision constructor (e.g. ``width_mult``, ``dropout``).

    Raises:
        ValueError: unknown ``net_type`` (valid names listed), bad ``input_size`` or ``num_classes``.
    """
    import torchvision

    size = _check_input_size(input_size)
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ConfigError(f"num_classes={num_classes!r} must be a positive integer")
    names = model_names()
    if not isinstance(net_type, str) or net_type.lower() not in names:
        raise ConfigError(f"unknown net_type {net_type!r}; choose from {names}")
    net_type = net_type.lower()
    model = torchvision.models.get_model(net_type, weights=None, **kwargs)
    if pretrained is True:  # torchvision's weights fit the 1000-class model: load before resizing
        _load_pretrained(model, net_type, pretrained)
    replace_head(model, num_classes)
    if min(size) <= SMALL_INPUT:
        adapt_stem(model)
    if isinstance(pretrained, str) and pretrained:
        _load_pretrained(model, net_type, pretrained)
    return model
