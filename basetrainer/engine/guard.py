"""The loss of a step: the total to back-propagate, and finding a non-finite one without a host
sync per step."""
from typing import Any, List, Tuple

import torch


def total_loss(losses: Any) -> torch.Tensor:
    """The loss to back-propagate: a tensor as is, the sum of a tuple/list or of a dict's values."""
    if isinstance(losses, torch.Tensor):
        return losses
    if isinstance(losses, dict):
        losses = list(losses.values())
    if isinstance(losses, (list, tuple)) and losses:
        return sum(losses[1:], losses[0])
    raise TypeError(f"run_step must return losses as a tensor, tuple or dict of tensors, got {type(losses).__name__}")


class NonFiniteGuard:
    """Each step only keeps a reference to the detached loss; every ``log_freq`` steps, at the
    end of the epoch and before any checkpoint, the pending losses are checked at once, and the
    first bad one raises :class:`FloatingPointError` naming its epoch, step and losses.
    """

    def __init__(self) -> None:
        self.pending: List[Tuple[int, torch.Tensor, Any]] = []

    def watch(self, batch: int, loss: torch.Tensor, losses: Any) -> None:
        detached = loss.detach()
        parts = detached if losses is loss else losses.detach() if isinstance(losses, torch.Tensor) else (
            {k: v.detach() for k, v in losses.items()} if isinstance(losses, dict)
            else [v.detach() for v in losses])
        self.pending.append((batch, detached, parts))

    def check(self, epoch: int) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        finite = torch.isfinite(torch.stack([p[1].float().reshape(()) for p in pending]))
        if bool(finite.all()):
            return
        batch, loss, parts = pending[int((~finite).nonzero()[0])]
        if isinstance(parts, dict):
            shown = {k: float(v) for k, v in parts.items()}
        elif isinstance(parts, list):
            shown = [float(v) for v in parts]
        else:
            shown = float(parts)
        raise FloatingPointError(
            f"non-finite loss at epoch {epoch}, step {batch}: loss={float(loss)} (losses: {shown}). "
            f"Lower the learning rate, enable clip_grad_norm, or check the data and the model.")
