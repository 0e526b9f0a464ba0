"""The structural step: remove channels for real, with torch-pruning's dependency graph.

torch-pruning traces the model, groups the layers whose channels are coupled (a convolution,
its BatchNorm, the next layer's inputs, every branch of a residual sum, a depthwise chain) and
removes the same channels from all of them, so the pruned model stays consistent.

``torch_pruning`` is imported inside the functions only: importing this module is free.
"""
import inspect
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

from basetrainer.pruning.options import INSTALL_HINTS
from basetrainer.runtime.errors import MissingExtraError

#: prune_type -> (torch-pruning importance class, its keyword arguments).
IMPORTANCES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "l1": ("MagnitudeImportance", {"p": 1}),
    "l2": ("MagnitudeImportance", {"p": 2}),
    "fpgm": ("FPGMImportance", {}),
    "slim": ("BNScaleImportance", {}),
}

LayerRef = Union[str, nn.Module]


def import_torch_pruning() -> Any:
    """Import and return the ``torch_pruning`` module.

    Raises:
        ImportError: torch-pruning is not installed; the message names the pip extra.
    """
    try:
        import torch_pruning
    except ImportError as exc:
        raise MissingExtraError(
            "structured pruning needs the torch-pruning package (torch-pruning>=1.3), which is "
            f"not installed; install it with: {INSTALL_HINTS['torch-pruning']}") from exc
    return torch_pruning


def make_importance(prune_type: str) -> Callable[..., Optional[torch.Tensor]]:
    """torch-pruning's channel-importance estimator for ``prune_type`` (a key of IMPORTANCES)."""
    tp = import_torch_pruning()
    class_name, kwargs = IMPORTANCES[prune_type]
    cls = getattr(tp.importance, class_name, None)
    if cls is None:
        raise MissingExtraError(f"prune_type={prune_type!r} needs torch_pruning.importance.{class_name}, "
                                f"missing from torch-pruning {getattr(tp, '__version__', '?')}; "
                                'upgrade with: pip install -U "torch-pruning>=1.3"')
    return cls(**kwargs)


def _run(model: nn.Module, example_inputs: torch.Tensor) -> Any:
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            return model(example_inputs)
    finally:
        model.train(was_training)


def find_head(model: nn.Module, example_inputs: torch.Tensor) -> Optional[nn.Module]:
    """The classifier head: the last :class:`~torch.nn.Linear` the forward pass runs.

    Falls back to the last convolution run when the model has no Linear layer (a fully
    convolutional network), since that layer's outputs are the model's outputs.

    Args:
        model: The network.
        example_inputs: A batch shaped like the real input.

    Returns:
        The head module, or ``None`` when the forward pass runs neither kind of layer.
    """
    order: List[nn.Module] = []
    handles = [m.register_forward_hook(lambda mod, _inp, _out: order.append(mod))
               for m in model.modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))]
    try:
        _run(model, example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    linears = [m for m in order if isinstance(m, nn.Linear)]
    if linears:
        return linears[-1]
    return order[-1] if order else None


def resolve_ignored(model: nn.Module, ignored_layers: Optional[Iterable[LayerRef]]) -> List[nn.Module]:
    """Turn ``ignored_layers`` (modules and/or qualified module names) into modules of ``model``.

    Raises:
        ValueError: A name is not a module of ``model``, or a module is not part of it.
        TypeError: An entry is neither a string nor a module.
    """
    if ignored_layers is None:
        return []
    if isinstance(ignored_layers, (str, nn.Module)):
        ignored_layers = [ignored_layers]
    by_name = dict(model.named_modules())
    members = {id(m) for m in by_name.values()}
    resolved = []
    for entry in ignored_layers:
        if isinstance(entry, str):
            if entry not in by_name:
                examples = [n for n in by_name if n][:5]
                raise ValueError(f"ignored_layers names {entry!r}, which is not a module of the "
                                 f"model; use qualified names from model.named_modules(), e.g. "
                                 f"{examples}")
            resolved.append(by_name[entry])
        elif isinstance(entry, nn.Module):
            if id(entry) not in members:
                raise ValueError(f"ignored_layers holds a {type(entry).__name__} that is not part "
                                 "of the model being pruned; pass the model's own module or its name")
            resolved.append(entry)
        else:
            raise TypeError(f"ignored_layers entries must be modules or module names, got "
                            f"{entry!r} of type {type(entry).__name__}")
    return resolved


def output_shapes(model: nn.Module, example_inputs: torch.Tensor) -> Any:
    """The shapes of everything ``model`` returns (tensors inside tuples/lists/dicts too)."""

    def shapes(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        if isinstance(value, dict):
            return {key: shapes(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [shapes(item) for item in value]
        return type(value).__name__

    return shapes(_run(model, example_inputs))


def prune_channels(model: nn.Module, example_inputs: torch.Tensor,
                   importance: Callable[..., Optional[torch.Tensor]], sparsity: float,
                   ignored_layers: Iterable[nn.Module], round_to: Optional[int] = None) -> None:
    """Remove ``sparsity`` of the output channels of every prunable group of ``model``, in place.

    Args:
        model: The network; its layers are replaced by thinner ones in place.
        example_inputs: A batch shaped like the real input, on the model's device (for tracing).
        importance: Scores the channels of a torch-pruning group; the lowest-scored are removed.
        sparsity: Fraction of each group's channels to remove, in (0, 1).
        ignored_layers: Layers whose output channels are kept (their inputs may still shrink).
        round_to: Keep a multiple of this many channels per layer (e.g. 8 for tensor cores).
    """
    tp = import_torch_pruning()
    pruner_cls = getattr(tp.pruner, "BasePruner", None) or tp.pruner.MetaPruner
    accepted = inspect.signature(pruner_cls.__init__).parameters
    ratio_key = "pruning_ratio" if "pruning_ratio" in accepted else "ch_sparsity"
    was_training = model.training
    try:
        model.eval()  # trace without touching BatchNorm statistics
        with torch.enable_grad():
            pruner = pruner_cls(model, example_inputs, importance=importance,
                                ignored_layers=list(ignored_layers), round_to=round_to,
                                **{ratio_key: sparsity})
            pruner.step()
    finally:
        model.train(was_training)
