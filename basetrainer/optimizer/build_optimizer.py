"""Optimizers by name: SGD, Adam, AdamW, RMSprop (case-insensitive)."""
from typing import Any, Callable, Dict, Iterable, List, Union

import torch
from torch import nn

from basetrainer.runtime.errors import ConfigError
from basetrainer.utils.setup_config import LR_RULE, valid_lr

_OPTIMIZERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr, momentum, weight_decay, **kw: torch.optim.SGD(
        params, lr=lr, momentum=momentum, weight_decay=weight_decay, **kw),
    "adam": lambda params, lr, momentum, weight_decay, **kw: torch.optim.Adam(
        params, lr=lr, weight_decay=weight_decay, **kw),
    "adamw": lambda params, lr, momentum, weight_decay, **kw: torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, **kw),
    "rmsprop": lambda params, lr, momentum, weight_decay, **kw: torch.optim.RMSprop(
        params, lr=lr, momentum=momentum, weight_decay=weight_decay, **kw),
}
_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "rmsprop": "RMSprop"}


def optimizer_names() -> List[str]:
    return sorted(_NAMES.values())


def param_groups(model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """Two groups: weights with ``weight_decay``; biases and normalisation parameters without."""
    norm_types = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm,
                  nn.modules.instancenorm._InstanceNorm)
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if isinstance(module, norm_types) or name.endswith("bias") or param.ndim <= 1
             else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def get_optimizer(model: Union[nn.Module, Iterable[Any]], optim_type: str = "SGD", lr: float = 0.1,
                  momentum: float = 0.9, weight_decay: float = 5e-4, no_decay_norm_bias: bool = False,
                  **kwargs: Any) -> torch.optim.Optimizer:
    """Build an optimizer for ``model``'s trainable parameters.

    Args:
        model: a module (or an iterable of parameters / parameter groups).
        optim_type: ``SGD``, ``Adam``, ``AdamW`` or ``RMSprop`` (any case).
        lr: learning rate, a finite number >= 0 (0 leaves the weights as they are).
        momentum: momentum (SGD, RMSprop).
        weight_decay: L2 penalty / decoupled decay (AdamW).
        no_decay_norm_bias: exclude biases and normalisation parameters from weight decay.
        **kwargs: passed to the torch optimizer (e.g. ``nesterov=True``, ``betas=(0.9, 0.99)``).

    Raises:
        ValueError: unknown ``optim_type`` (the valid names are listed) or bad numbers.
    """
    key = optim_type.strip().lower() if isinstance(optim_type, str) else None
    if key not in _OPTIMIZERS:
        raise ConfigError(f"unknown optim_type {optim_type!r}; choose from {optimizer_names()}")
    if not valid_lr(lr):
        raise ConfigError(f"lr={lr!r} {LR_RULE}")
    if weight_decay is None or weight_decay < 0:
        raise ConfigError(f"weight_decay={weight_decay!r} must be >= 0")
    if isinstance(model, nn.Module):
        params: Any = (param_groups(model, weight_decay) if no_decay_norm_bias
                       else [p for p in model.parameters() if p.requires_grad])
    else:
        params = list(model)
    if not params or (isinstance(params[0], dict) and not any(g["params"] for g in params)):
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    return _OPTIMIZERS[key](params, lr=lr, momentum=momentum or 0.0, weight_decay=weight_decay, **kwargs)
