"""Network-slimming regulariser: an L1 penalty on BatchNorm scales, as a training callback.

Network slimming (Liu et al., 2017, https://arxiv.org/abs/1708.06519) trains with an L1 penalty
on the BatchNorm scale factors so that unimportant channels end with scales near zero; pruning
with ``prune_type="slim"`` then removes the channels with the smallest ``|scale|``.
"""
from typing import Any, List, Optional

import torch
from torch import nn

from basetrainer.callbacks.callbacks import Callback
from basetrainer.runtime.modules import unwrap_model as _unwrap


class SlimRegularizer(Callback):
    """Adds ``penalty * sign(w)`` to the gradient of every BatchNorm weight ``w`` while training.

    That is the subgradient of ``penalty * sum(|w|)``, the network-slimming L1 term, without
    touching the loss. It is installed as a hook on each BatchNorm weight in ``on_train_begin``
    and removed in ``on_train_end``, so it works the same on CPU, one GPU, DataParallel and DDP
    (the hooks sit on the parameters of the unwrapped model; under DDP every rank adds the same
    term before the all-reduce, so the average is unchanged).

    When the engine scales the loss for mixed precision and exposes the scaler as
    ``trainer.scaler`` (a ``torch.cuda.amp.GradScaler``-like object), the penalty is multiplied
    by the current scale each batch so the step sees exactly ``penalty * sign(w)``. Each
    ``backward()`` adds the term once, so with gradient accumulation over ``k`` micro-batches the
    effective penalty is ``k * penalty``.

    Args:
        penalty: Weight of the L1 term (typically 1e-5 to 1e-4); must be >= 0.

    Example::

        trainer = MyTrainer(cfg)
        trainer.callbacks.append(SlimRegularizer(penalty=1e-4))
        trainer.run()
        pruned = model_pruning(trainer.model, [224, 224], prune_type="slim")
    """

    def __init__(self, penalty: float = 1e-4) -> None:
        super().__init__()
        penalty = float(penalty)
        if not penalty >= 0.0:
            raise ValueError(f"penalty must be a number >= 0, got {penalty!r}; e.g. penalty=1e-4")
        self.penalty = penalty
        self._scale = 1.0
        self._handles: List[Any] = []

    def _target(self) -> nn.Module:
        model = getattr(self.trainer, "model", None) if self.trainer is not None else None
        model = model if model is not None else self.model
        if model is None:
            raise RuntimeError("SlimRegularizer has no model: call set_trainer(trainer) (the "
                               "engine does) or set_model(model) before on_train_begin")
        return _unwrap(model)

    def _make_hook(self, weight: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            return grad + (self.penalty * self._scale) * torch.sign(weight.detach())

        return hook

    def attach(self, model: Optional[nn.Module] = None) -> int:
        """Install the gradient hooks (``on_train_begin`` calls this); returns how many.

        Args:
            model: The model to regularise; the trainer's (unwrapped) model when ``None``.
        """
        self.detach()
        target = _unwrap(model) if model is not None else self._target()
        for module in target.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.weight is not None \
                    and module.weight.requires_grad:
                self._handles.append(module.weight.register_hook(self._make_hook(module.weight)))
        return len(self._handles)

    def detach(self) -> None:
        """Remove the gradient hooks (``on_train_end`` calls this)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.attach()

    def on_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        scaler = getattr(self.trainer, "scaler", None)
        enabled = scaler is not None and callable(getattr(scaler, "is_enabled", None)) \
            and scaler.is_enabled()
        self._scale = float(scaler.get_scale()) if enabled else 1.0

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        self.detach()
