"""basetrainer: a small, Keras-style training engine for PyTorch.

Subclass :class:`EngineTrainer`, fill in its ``build_*`` hooks and call ``run()``; the same script
trains on CPU, one GPU, DataParallel and DistributedDataParallel (see :func:`launch`).

The public names are imported lazily, so ``import basetrainer`` costs next to nothing and
imports neither torch nor any optional dependency until one of them is used.
"""
from typing import TYPE_CHECKING, Any

__version__ = "2.0.0"
__all__ = ["__version__", "EngineTrainer", "Engine", "Callback", "launch"]

_LAZY = {
    "EngineTrainer": ("basetrainer.engine.trainer", "EngineTrainer"),
    "Engine": ("basetrainer.engine.engine", "Engine"),
    "Callback": ("basetrainer.callbacks.callbacks", "Callback"),
    "launch": ("basetrainer.engine.launch", "launch"),
}

if TYPE_CHECKING:  # pragma: no cover
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.engine.engine import Engine
    from basetrainer.engine.launch import launch
    from basetrainer.engine.trainer import EngineTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'basetrainer' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + list(_LAZY))
