"""BatchNorm whose batch statistics cover every process, on any device (gloo on CPU too).

torch's :class:`~torch.nn.SyncBatchNorm` runs on GPUs only. This one sums the per-channel
count, sum and sum of squares with an autograd-aware all-reduce, so forward and backward equal
plain BatchNorm over the global batch; on CUDA the trainer uses torch's own.
"""
import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce


_placeholder = False


@contextlib.contextmanager
def placeholder_batch(active: bool = True) -> Iterator[None]:
    """While active, this rank's batch is a placeholder (its share of the global batch is
    empty): GlobalBatchNorm layers count none of its samples in the batch statistics, though
    the forward runs (the other ranks wait for its collectives)."""
    global _placeholder
    previous, _placeholder = _placeholder, bool(active)
    try:
        yield
    finally:
        _placeholder = previous


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch (all processes); plain BatchNorm in eval or alone."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)
        self._check_input_dim(input)
        dims = [0] + list(range(2, input.dim()))
        count = torch.full((1,), input.numel() / input.shape[1], dtype=input.dtype, device=input.device)
        stats = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        if _placeholder:
            stats = stats * 0
        stats = all_reduce(stats)
        c = input.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                unbiased = var * n / (n - 1).clamp(min=1)
                self.running_mean.mul_(1 - momentum).add_(momentum * mean)
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased)
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (input - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm layer by :class:`GlobalBatchNorm` (weights and statistics kept)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, GlobalBatchNorm):
        new = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                new.weight.copy_(module.weight)
                new.bias.copy_(module.bias)
        if module.track_running_stats:
            new.running_mean.copy_(module.running_mean)
            new.running_var.copy_(module.running_var)
            new.num_batches_tracked.copy_(module.num_batches_tracked)
        new.train(module.training)
        return new.to(next(module.buffers(), torch.empty(0)).device)
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child))
    return module
