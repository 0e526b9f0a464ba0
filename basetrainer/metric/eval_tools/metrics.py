"""Running averages and top-k accuracy (precision@k), as basetrainer 1.0.4 named them."""
from typing import Any, Dict, List, Optional, Sequence

import torch


class AverageMeter:
    """The current value, sum, count and average of a series (``update(val, n)`` adds ``val``
    weighted by ``n`` samples)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.val = 0.0
        self.avg = 0.0
        self.sum = 0.0
        self.count = 0

    def update(self, val: Any, n: int = 1) -> None:
        if isinstance(val, torch.Tensor):
            val = val.item()
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count if self.count else 0.0


class MultiAverageMeter:
    """An :class:`AverageMeter` per key: ``update({"loss": 0.3, "acc": 90.0}, n)``."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.meters: Dict[str, AverageMeter] = {k: AverageMeter() for k in keys}

    def reset(self, keys: Optional[Sequence[str]] = None) -> None:
        for k in keys if keys is not None else list(self.meters):
            self.meters.setdefault(k, AverageMeter()).reset()

    def update(self, items: Dict[str, Any], n: int = 1) -> None:
        for k, v in items.items():
            self.meters.setdefault(k, AverageMeter()).update(v, n)

    def __getitem__(self, key: str) -> AverageMeter:
        return self.meters[key]


def accuracy(pred: torch.Tensor, target: torch.Tensor, topk: Sequence[int] = (1,)) -> List[torch.Tensor]:
    """Top-k accuracy in percent (precision@k), one 1-element tensor per k (as in the original and
    PyTorch's ImageNet example).

    Args:
        pred: scores ``[batch, num_classes]``.
        target: class indices ``[batch]``.
        topk: the k values.

    Raises:
        ValueError: shapes that do not match, a k larger than the number of classes, or a
            target outside ``[0, num_classes)``.
    """
    if pred.dim() != 2 or target.dim() != 1 or pred.shape[0] != target.shape[0]:
        raise ValueError(f"accuracy expects pred [batch, num_classes] and target [batch]; got "
                         f"{tuple(pred.shape)} and {tuple(target.shape)}")
    classes = pred.shape[1]
    if max(topk) > classes:
        raise ValueError(f"topk={tuple(topk)}: k cannot exceed the {classes} classes of pred")
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= classes):
        raise ValueError(f"target holds class {int(target.max())} (or a negative one), but pred has {classes} "
                         f"classes (0..{classes - 1})")
    with torch.no_grad():
        batch = max(1, target.shape[0])
        _, top = pred.topk(max(topk), dim=1, largest=True, sorted=True)
        hit = top.eq(target.view(-1, 1))
        return [hit[:, :k].any(dim=1).float().sum().reshape(1).mul_(100.0 / batch) for k in topk]
