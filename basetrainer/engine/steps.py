"""The steps of an epoch: accumulation windows, and the weight of each rank's loss.

The gradient of an optimizer step must be the gradient of the mean loss over every sample of
its window (one or ``accumulate_steps`` global batches), whatever the world size and however
unevenly the last batch splits. With a loader made by ``build_dataloader`` each rank knows its
share ``n`` of global batch k and the batch's size ``N_k`` (its batch sampler's ``share``), so
with ``run_step`` returning the mean over the rank's samples (``loss_reduction: mean``) the rank
scales its loss by ``n * W / sum(N over the window)``; DDP's average over the W ranks then gives
exactly the window's mean. With ``loss_reduction: sum`` (``run_step`` returns the sum over the
rank's samples) the scale is ``W / sum(N)``. Other loaders: every micro-batch counts the same,
``1 / window length``. A rank with an empty share (a placeholder batch) gets weight 0.
"""
from typing import Any, Tuple


class EpochSteps:
    """Windows and loss weights of one epoch of ``loader``.

    Args:
        loader: the train loader.
        accumulate_steps: micro-batches per optimizer step.
        loss_reduction: ``"mean"`` or ``"sum"``: what ``run_step``'s loss is over this rank's samples.
    """

    def __init__(self, loader: Any, accumulate_steps: int, loss_reduction: str = "mean") -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r} must be 'mean' (run_step returns the mean "
                             f"loss over the batch, the default) or 'sum' (the sum over the batch)")
        self.steps = len(loader)
        self.k = accumulate_steps
        self.reduction = loss_reduction
        sampler = getattr(loader, "batch_sampler", None)
        self.share = getattr(sampler, "share", None)
        self.world = int(getattr(sampler, "world", 1) or 1)

    def window(self, batch: int) -> Tuple[int, int]:
        """The first and one-past-last step of ``batch``'s accumulation window."""
        start = (batch // self.k) * self.k
        return start, min(start + self.k, self.steps)

    def is_update(self, batch: int) -> bool:
        """Whether ``batch`` ends its window (the optimizer steps after it)."""
        return batch + 1 >= self.window(batch)[1]

    def plan(self, batch: int) -> Tuple[bool, float, bool]:
        """``(optimizer steps after this batch, loss weight, placeholder batch)``."""
        start, end = self.window(batch)
        update = batch + 1 >= end
        if self.share is None:
            if self.reduction == "sum":
                raise ValueError("loss_reduction='sum' needs a train loader made by build_dataloader "
                                 "(its batch sampler tells each rank the size of every global batch)")
            return update, 1.0 / (end - start), False
        n, total = self.share(batch)
        if end - start > 1:
            total = sum(self.share(b)[1] for b in range(start, end))
        weight = (n if self.reduction == "mean" else (1 if n else 0)) * self.world / total
        return update, weight, n == 0
