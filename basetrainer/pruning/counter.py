"""A small parameter and MAC counter (forward hooks on convolutions and linear layers).

Only convolutions and :class:`torch.nn.Linear` are counted: they hold nearly all the
multiply-accumulates of a CNN; normalisation, activations and pooling are left out.

* convolution: ``output elements * in_channels / groups * prod(kernel_size)``
* transposed convolution: ``input elements * out_channels / groups * prod(kernel_size)``
* linear: ``output elements * in_features``

MACs are reported per sample (the total divided by the batch size of the example input).
"""
import math
from dataclasses import dataclass
from typing import Any, List

import torch
from torch import nn


@dataclass(frozen=True)
class ModelCost:
    """Size and compute of a model for one input sample.

    Attributes:
        params: Number of parameters (shared parameters counted once).
        macs: Multiply-accumulates of the convolutions and linear layers, per sample.
    """

    params: int
    macs: int


def count_params(model: nn.Module) -> int:
    """Number of parameters of ``model`` (a parameter shared by two layers counts once)."""
    return sum(p.numel() for p in model.parameters())


def _layer_macs(module: nn.Module, inputs: Any, output: Any) -> int:
    if isinstance(module, nn.Linear):
        return output.numel() * module.in_features
    kernel = math.prod(module.kernel_size)
    if module.transposed:
        return inputs[0].numel() * (module.out_channels // module.groups) * kernel
    return output.numel() * (module.in_channels // module.groups) * kernel


def count_macs(model: nn.Module, example_inputs: torch.Tensor) -> int:
    """Multiply-accumulates of one forward pass of ``model``, per sample.

    The model runs once in eval mode under ``torch.no_grad()`` (so BatchNorm statistics are not
    touched); its train/eval mode is restored afterwards.

    Args:
        model: The network.
        example_inputs: A batch shaped like the real input, on the model's device.

    Returns:
        MACs of the convolutions and linear layers for one sample.
    """
    total: List[int] = []

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        total.append(_layer_macs(module, inputs, output))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear))]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(example_inputs)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    batch = int(example_inputs.shape[0]) if example_inputs.dim() else 1
    return sum(total) // max(batch, 1)


def profile_model(model: nn.Module, example_inputs: torch.Tensor) -> ModelCost:
    """Parameters and per-sample MACs of ``model`` (see :func:`count_macs`)."""
    return ModelCost(params=count_params(model), macs=count_macs(model, example_inputs))
