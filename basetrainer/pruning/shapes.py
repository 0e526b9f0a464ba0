"""Layer shape records: what a pruned layer looks like, and how to rebuild it from the record.

A record is a plain dict (strings, ints, floats, bools, lists), so it can be stored in a file
that ``torch.load(..., weights_only=True)`` reads. Structural pruning changes the channels (and,
for depthwise convolutions, the groups) of convolutions, normalisation layers and linear layers;
:func:`layer_shapes` records exactly those layers and :func:`reshape_to` replaces the ones of a
dense model whose record differs, so the pruned ``state_dict`` then loads into it.
"""
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

LayerSpec = Dict[str, Any]

#: Layer classes a record may name; the record's ``"type"`` is looked up here, never imported.
REBUILDABLE: Dict[str, type] = {
    cls.__name__: cls for cls in (
        nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
        nn.Linear, nn.LayerNorm, nn.GroupNorm,
    )
}


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _conv_spec(m: nn.modules.conv._ConvNd) -> LayerSpec:
    spec = {
        "in_channels": m.in_channels, "out_channels": m.out_channels,
        "kernel_size": _as_list(m.kernel_size), "stride": _as_list(m.stride),
        "padding": _as_list(m.padding), "dilation": _as_list(m.dilation),
        "groups": m.groups, "bias": m.bias is not None, "padding_mode": m.padding_mode,
    }
    if m.transposed:
        spec["output_padding"] = _as_list(m.output_padding)
    return spec


def _has_bias(m: nn.Module, affine: bool) -> bool:
    # newer torch lets normalisation layers drop their bias; without affine it is moot
    return getattr(m, "bias", None) is not None or not affine


def _bn_spec(m: nn.modules.batchnorm._BatchNorm) -> LayerSpec:
    return {"num_features": m.num_features, "eps": m.eps, "momentum": m.momentum,
            "affine": m.affine, "track_running_stats": m.track_running_stats,
            "bias": _has_bias(m, m.affine)}


def _linear_spec(m: nn.Linear) -> LayerSpec:
    return {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None}


def _layernorm_spec(m: nn.LayerNorm) -> LayerSpec:
    return {"normalized_shape": list(m.normalized_shape), "eps": m.eps,
            "elementwise_affine": m.elementwise_affine, "bias": _has_bias(m, m.elementwise_affine)}


def _groupnorm_spec(m: nn.GroupNorm) -> LayerSpec:
    return {"num_groups": m.num_groups, "num_channels": m.num_channels, "eps": m.eps,
            "affine": m.affine, "bias": _has_bias(m, m.affine)}


_SPECS: List[Tuple[type, Callable[[Any], LayerSpec]]] = [
    (nn.modules.conv._ConvNd, _conv_spec),
    (nn.modules.batchnorm._BatchNorm, _bn_spec),
    (nn.Linear, _linear_spec),
    (nn.LayerNorm, _layernorm_spec),
    (nn.GroupNorm, _groupnorm_spec),
]


def layer_spec(module: nn.Module) -> Optional[LayerSpec]:
    """The shape record of one layer, or ``None`` for a layer type that is not recorded.

    Args:
        module: Any module.

    Returns:
        ``{"type": class name, <constructor arguments>}`` for a convolution, BatchNorm, Linear,
        LayerNorm or GroupNorm whose class is in :data:`REBUILDABLE`; otherwise ``None``.
    """
    name = type(module).__name__
    if REBUILDABLE.get(name) is not type(module):
        return None
    for cls, make in _SPECS:
        if isinstance(module, cls):
            return {"type": name, **make(module)}
    return None


def layer_shapes(model: nn.Module) -> Dict[str, LayerSpec]:
    """Shape records of every recordable layer of ``model``, keyed by qualified module name."""
    shapes = {}
    for name, module in model.named_modules():
        spec = layer_spec(module)
        if spec is not None and name:
            shapes[name] = spec
    return shapes


def channels_of(spec: LayerSpec) -> Tuple[int, int]:
    """``(input channels, output channels)`` of a shape record (features for Linear)."""
    if "in_channels" in spec:
        return spec["in_channels"], spec["out_channels"]
    if "in_features" in spec:
        return spec["in_features"], spec["out_features"]
    if "num_features" in spec:
        return spec["num_features"], spec["num_features"]
    if "num_channels" in spec:
        return spec["num_channels"], spec["num_channels"]
    last = spec["normalized_shape"][-1]
    return last, last


def build_layer(spec: LayerSpec) -> nn.Module:
    """A freshly initialised layer of the shape ``spec`` records.

    Raises:
        ValueError: The record names a type outside :data:`REBUILDABLE`.
    """
    cls = REBUILDABLE.get(spec.get("type"))
    if cls is None:
        raise ValueError(f"cannot rebuild a layer of type {spec.get('type')!r}; "
                         f"supported types are {sorted(REBUILDABLE)}")
    accepted = inspect.signature(cls).parameters
    # an older torch may lack an argument (e.g. BatchNorm's bias); the default is what it had
    kwargs = {key: _as_tuple(value) for key, value in spec.items() if key in accepted}
    return cls(**kwargs)


def _floating_tensor(module: nn.Module) -> Optional[torch.Tensor]:
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.is_floating_point():
            return tensor
    return None


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def reshape_to(model: nn.Module, shapes: Dict[str, LayerSpec]) -> List[str]:
    """Replace every layer of ``model`` whose shape differs from ``shapes`` with a new one.

    The new layers are freshly initialised on the old layer's device and dtype; load the pruned
    ``state_dict`` afterwards to give them their weights.

    Args:
        model: A dense model of the same architecture as the one the records were taken from.
        shapes: The output of :func:`layer_shapes` on the pruned model.

    Returns:
        The names of the layers that were replaced.

    Raises:
        ValueError: A recorded layer is missing from ``model`` or has another type.
    """
    modules = dict(model.named_modules())
    replaced = []
    for name, spec in shapes.items():
        old = modules.get(name)
        if old is None or type(old).__name__ != spec.get("type"):
            found = "nothing" if old is None else type(old).__name__
            raise ValueError(
                f"the saved pruned model has a {spec.get('type')} at {name!r} but this model has "
                f"{found} there; pass the same architecture the pruned file was made from, or "
                "prune again with reuse=False")
        if layer_spec(old) == spec:
            continue
        new = build_layer(spec)
        reference = _floating_tensor(old)
        if reference is not None:
            new = new.to(device=reference.device, dtype=reference.dtype)
        new.train(old.training)
        _set_submodule(model, name, new)
        replaced.append(name)
    return replaced
