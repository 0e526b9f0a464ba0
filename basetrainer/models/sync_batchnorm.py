"""BatchNorm whose batch statistics cover every process, on any device (gloo on CPU too).

torch's :class:`~torch.nn.SyncBatchNorm` runs on GPUs only; on CUDA the trainer uses it, elsewhere
:class:`GlobalBatchNorm`. Each process computes its sample count, mean and sum of squared
deviations (M2) in float64; one differentiable all-gather hands every process all of them, and
Chan's parallel formula combines them. So the mean and variance are those of the global batch to
float64 accuracy (no ``E[x²] - mean²`` cancellation: inputs of mean 1000 and std 0.01 are fine),
the forward and the backward equal plain BatchNorm over the global batch, and a process may
contribute no sample at all: an empty input, or a placeholder batch run under
:func:`placeholder_batch`.
"""
import contextlib
import contextvars
from typing import Any, Iterator, Tuple

import torch
import torch.distributed as dist
from torch import nn

_PLACEHOLDER = contextvars.ContextVar("basetrainer_batchnorm_placeholder", default=False)


@contextlib.contextmanager
def placeholder_batch() -> Iterator[None]:
    """Make this process's :class:`GlobalBatchNorm` layers count 0 samples inside the block.

    For a process whose share of a global batch is empty but which must still run the forward and
    backward (DDP's gradient all-reduce and the layers' statistics wait for every process): run a
    placeholder sample (any sample of the data set) under this block and give its loss the weight
    0. The layers normalise the placeholder with the other processes' statistics and update the
    running statistics from their samples only. If no process contributes a sample, the layers
    normalise with their running statistics and leave them as they are.

    Only :class:`GlobalBatchNorm` listens; torch's own BatchNorm layers (and SyncBatchNorm on CUDA)
    count the placeholder like any sample.

    Example:
        >>> with placeholder_batch():
        ...     outputs = model(placeholder)
        >>> loss = 0.0 * criterion(outputs, placeholder_targets)
    """
    token = _PLACEHOLDER.set(True)
    try:
        yield
    finally:
        _PLACEHOLDER.reset(token)


class _AllGather(torch.autograd.Function):
    """Stack one small tensor from every process; the gradient of a process's tensor is the sum,
    over the processes, of the gradients of its gathered copies.

    ``anchor`` (the layer's input) only puts this node in the graph wherever the input requires a
    gradient, also on a process whose own tensor does not depend on it (no sample), so that every
    process runs the backward's collective. (Written on ``dist.all_gather``/``all_reduce``:
    torch 2.14 deprecates ``torch.distributed.nn.functional``, and its replacement is missing
    from older torch.)
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: torch.Tensor,
                anchor: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor.contiguous())
        return torch.stack(gathered)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[dist.get_rank()], None


def _combine(stats: torch.Tensor, channels: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan's parallel formula over rows of ``[count, mean (C), M2 (C)]``: (count, mean, M2)."""
    counts, means, m2s = stats[:, :1], stats[:, 1:channels + 1], stats[:, channels + 1:]
    count = counts.sum()
    mean = (counts * means).sum(0) / count.clamp(min=1)
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return count, mean, m2


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch (all processes); plain BatchNorm in eval or alone.

    Statistics are computed in float64 and the normalisation in the input's precision (float32
    for bfloat16/float16 inputs, the result cast back), with the mean split into a float32 part
    and a remainder so that ``x - mean`` stays exact for inputs far from zero. Running statistics
    take the unbiased global variance, as torch's BatchNorm does.

    Example:
        >>> model = convert_sync_batchnorm(model)   # before wrapping it in DDP
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"GlobalBatchNorm expects an input of shape (N, C, ...), got {input.dim()}D input of "
                             f"shape {tuple(input.shape)}; add the batch dimension (e.g. x.unsqueeze(0))")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        placeholder = _PLACEHOLDER.get()
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not (self.training and (distributed or placeholder)):
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        count = 0 if placeholder else input.numel() // max(channels, 1)
        x64 = input.to(torch.float64)
        if count:
            var, mean = torch.var_mean(x64, dims, correction=0)
            local = torch.cat([x64.new_full((1,), count), mean, var * count])
        else:  # nothing of this process's input counts (and no gradient flows through its statistics)
            local = x64.new_zeros(1 + 2 * channels)
        stats = _AllGather.apply(local, input) if distributed else local[None]
        count_all, mean, m2 = _combine(stats, channels)
        var = m2 / count_all.clamp(min=1)
        if self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(count_all, mean, m2)
            some = count_all > 0  # no sample anywhere: normalise like eval (no host sync to decide)
            mean = torch.where(some, mean, self.running_mean.to(torch.float64))
            var = torch.where(some, var, self.running_var.to(torch.float64))
        return self._normalise(input, mean, var)

    def _update_running_stats(self, count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Move the running mean and unbiased variance toward the global batch's (if it has a sample)."""
        with torch.no_grad():
            some = count > 0
            self.num_batches_tracked.add_(some.to(self.num_batches_tracked.dtype))
            momentum: Any = self.momentum
            if momentum is None:  # cumulative moving average (a tensor: no host sync)
                momentum = 1.0 / self.num_batches_tracked.clamp(min=1).to(torch.float64)
            unbiased = m2 / (count - 1).clamp(min=1)
            for buffer, batch in ((self.running_mean, mean), (self.running_var, unbiased)):
                old = buffer.to(torch.float64)
                buffer.copy_(torch.where(some, (1 - momentum) * old + momentum * batch, old))

    def _normalise(self, input: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """``(input - mean) / sqrt(var + eps) * weight + bias`` from float64 ``mean`` and ``var``."""
        dtype = input.dtype if input.dtype in (torch.float32, torch.float64) else torch.float32
        shape = [1, -1] + [1] * (input.dim() - 2)
        high = mean.detach().to(dtype)  # x - high is exact where x is near the mean,
        low = (mean - high.to(torch.float64)).to(dtype)  # and low carries the rest (and the gradient)
        centred = (input.to(dtype) - high.reshape(shape)) - low.reshape(shape)
        scale = torch.rsqrt(var + self.eps)
        if self.affine:
            scale = scale * self.weight
        out = centred * scale.to(dtype).reshape(shape)
        if self.affine:
            out = out + self.bias.to(dtype).reshape(shape)
        return out.to(input.dtype)


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
