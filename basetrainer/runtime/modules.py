"""The user's model inside the wrappers training puts around it, and a model put in eval mode
for a while."""
import contextlib
from typing import Any, Iterator, Tuple

import torch
from torch import nn


class ModelWithLoss(nn.Module):
    """Model and criterion in one module, so that under DataParallel every replica computes
    the loss of its own slice; only outputs and two numbers per replica are gathered on the
    first device. Returns ``(outputs, loss x samples, samples)``: the engine divides the sums,
    which gives the exact sample-weighted mean over the whole batch."""

    def __init__(self, model: nn.Module, criterion: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.criterion = criterion

    def forward(self, data: Any, targets: torch.Tensor) -> Tuple[Any, torch.Tensor, torch.Tensor]:
        outputs = self.model(data)
        loss = self.criterion(outputs, targets)
        count = torch.full((1,), float(targets.shape[0]), device=loss.device)
        return outputs, loss.reshape(1) * count, count


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DistributedDataParallel / torch.compile /
    :class:`ModelWithLoss` wrappers (what checkpoints hold)."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif isinstance(model, ModelWithLoss):
            model = model.model
        else:
            return model


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block (a forward in train mode moves BatchNorm's running
    statistics), every module's own mode put back after it, also when the block raises
    (``model.train(was)`` would set them all alike: a frozen BatchNorm of a training model
    would train again)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training
