"""A model's parameter count and multiply-accumulates (MACs) per sample.

MACs are torch's own count, :class:`torch.utils.flop_counter.FlopCounterMode` (two FLOPs per
multiply-accumulate), over one forward pass: the matrix products and convolutions (``conv``,
``mm``/``addmm``, ``bmm``, attention), which hold nearly all the work of a CNN; normalisation,
activations, pooling and bias additions are left out. For convolutions and linear layers this
is the count of the forward hooks it replaced, to the unit (resnet18, mobilenet_v2, grouped,
transposed, 1d and 3d convolutions compared), and it also sees products written as functions.
torch-pruning's ``tp.utils.count_ops_and_params`` was not taken: it counts normalisation and
activations too (other figures than the reports before it), and it is an optional extra.

MACs are reported per sample (the total divided by the batch size of the example input).
"""
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelCost:
    """Size and compute of a model for one input sample.

    Attributes:
        params: Number of parameters (shared parameters counted once).
        macs: Multiply-accumulates of the convolutions and matrix products, per sample.
    """

    params: int
    macs: int


def count_params(model: nn.Module) -> int:
    """Number of parameters of ``model`` (a parameter shared by two layers counts once)."""
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, example_inputs: torch.Tensor) -> int:
    """Multiply-accumulates of one forward pass of ``model``, per sample.

    The model runs once in eval mode under ``torch.no_grad()`` (so BatchNorm statistics are not
    touched); its train/eval mode is restored afterwards.

    Args:
        model: The network.
        example_inputs: A batch shaped like the real input, on the model's device.

    Returns:
        MACs of the convolutions and matrix products for one sample.
    """
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as flops:
            model(example_inputs)
    finally:
        model.train(was_training)
    batch = int(example_inputs.shape[0]) if example_inputs.dim() else 1
    return flops.get_total_flops() // 2 // max(batch, 1)


def profile_model(model: nn.Module, example_inputs: torch.Tensor) -> ModelCost:
    """Parameters and per-sample MACs of ``model`` (see :func:`count_macs`)."""
    return ModelCost(params=count_params(model), macs=count_macs(model, example_inputs))
