"""Classification losses by name: CrossEntropyLoss (CELoss), LabelSmoothing, FocalLoss."""
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import nn
import torch.nn.functional as F

from basetrainer.runtime.errors import ConfigError


class FocalLoss(nn.Module):
    """Focal loss (Lin et al., 2017): ``-alpha_t * (1 - p_t) ** gamma * log(p_t)``, mean over the batch.

    Args:
        num_classes: number of classes (checks the outputs' width).
        gamma: focusing parameter (0 gives cross-entropy).
        alpha: optional per-class weights (a sequence of ``num_classes`` numbers).
    """

    def __init__(self, num_classes: Optional[int] = None, gamma: float = 2.0,
                 alpha: Optional[List[float]] = None) -> None:
        super().__init__()
        if gamma < 0:
            raise ValueError(f"gamma={gamma!r} must be >= 0")
        self.num_classes = num_classes
        self.gamma = gamma
        if alpha is not None:
            alpha_t = torch.as_tensor(alpha, dtype=torch.float32)
            if num_classes is not None and alpha_t.numel() != num_classes:
                raise ValueError(f"alpha has {alpha_t.numel()} values but num_classes={num_classes}")
            self.register_buffer("alpha", alpha_t)
        else:
            self.alpha = None

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits.float(), dim=1)
        log_pt = log_p.gather(1, targets.long().unsqueeze(1)).squeeze(1)
        loss = -((1.0 - log_pt.exp()) ** self.gamma) * log_pt
        if self.alpha is not None:
            loss = loss * self.alpha.to(loss.device)[targets.long()]
        return loss.mean()


_CRITERIA: Dict[str, Callable[..., nn.Module]] = {
    "CrossEntropyLoss": lambda num_classes, **kw: nn.CrossEntropyLoss(**kw),
    "LabelSmoothing": lambda num_classes, smoothing=0.1, **kw: nn.CrossEntropyLoss(label_smoothing=smoothing, **kw),
    "FocalLoss": lambda num_classes, **kw: FocalLoss(num_classes, **kw),
}
_ALIASES = {"celoss": "CrossEntropyLoss", "ce": "CrossEntropyLoss", "crossentropy": "CrossEntropyLoss",
            "labelsmoothingloss": "LabelSmoothing", "focal": "FocalLoss"}


def criterion_names() -> List[str]:
    return sorted(list(_CRITERIA) + ["CELoss"])


def get_criterion(loss_type: str = "CrossEntropyLoss", num_classes: Optional[int] = None,
                  device: Union[str, torch.device, None] = None, **kwargs: Any) -> nn.Module:
    """Build a loss by name.

    Args:
        loss_type: ``CrossEntropyLoss`` (alias ``CELoss``), ``LabelSmoothing`` or ``FocalLoss``
            (any case).
        num_classes: number of classes.
        device: where the loss's buffers go.
        **kwargs: passed on (``smoothing`` for LabelSmoothing; ``gamma``/``alpha`` for FocalLoss;
            ``weight`` for the cross-entropies).

    Raises:
        ValueError: unknown ``loss_type`` (the valid names are listed).
    """
    lookup = {k.lower(): k for k in _CRITERIA}
    key = loss_type.strip().lower() if isinstance(loss_type, str) else ""
    name = lookup.get(key) or _ALIASES.get(key.replace("_", "").replace("-", ""))
    if name is None:
        raise ConfigError(f"unknown loss_type {loss_type!r}; choose from {criterion_names()}")
    criterion = _CRITERIA[name](num_classes, **kwargs)
    return criterion.to(device) if device is not None else criterion
