"""The NNI backend: NNI 3.0's pruners choose the channels, torch-pruning removes them.

NNI's pruners only compute masks; its ``ModelSpeedup`` (which would shrink the layers) fails on
recent torch releases. So :func:`nni_channel_masks` runs an NNI pruner on a copy of the model
and turns its weight masks into one keep-vector per layer, and :class:`MaskImportance` feeds
those vectors to torch-pruning as channel scores: within a group of coupled layers (a residual
sum, say) a channel is kept when most of the group's NNI masks keep it.

``nni`` and ``torch_pruning`` are imported inside the functions only.
"""
import copy
from typing import Any, Callable, Dict, Iterable, Optional

import torch
from torch import nn

from basetrainer.pruning.options import INSTALL_HINTS
from basetrainer.pruning.structural import import_torch_pruning
from basetrainer.runtime.errors import MissingExtraError

#: prune_type -> NNI 3.0 pruner class in ``nni.compression.pruning``.
NNI_PRUNERS: Dict[str, str] = {"l1": "L1NormPruner", "l2": "L2NormPruner", "fpgm": "FPGMPruner"}


def import_nni_pruning() -> Any:
    """Import and return ``nni.compression.pruning`` (NNI >= 3.0).

    Raises:
        ImportError: NNI is not installed (or too old); the message names the pip extra.
    """
    try:
        from nni.compression import pruning
    except ImportError as exc:
        raise MissingExtraError(
            "backend='nni' needs NNI>=3.0 (nni.compression.pruning), which is not installed; "
            f"install it with: {INSTALL_HINTS['nni']} - or use backend='torch-pruning'") from exc
    return pruning


def nni_channel_masks(model: nn.Module, sparsity: float, prune_type: str,
                      exclude: Iterable[nn.Module] = ()) -> Dict[str, torch.Tensor]:
    """Per-layer output-channel keep masks chosen by NNI's pruner for ``prune_type``.

    The pruner runs on a deep copy, so ``model`` is left as it was.

    Args:
        model: The dense network.
        sparsity: Fraction of each Conv2d/Linear layer's output channels to mask.
        prune_type: A key of :data:`NNI_PRUNERS`.
        exclude: Modules (and everything inside them) NNI must not mask, e.g. the head.

    Returns:
        ``{module name: float tensor of 1 (keep) / 0 (prune) per output channel}``.

    Raises:
        ImportError: NNI is not installed.
        ValueError: NNI has no one-shot pruner for ``prune_type``.
    """
    if prune_type not in NNI_PRUNERS:
        raise ValueError(
            f"prune_type={prune_type!r} is not available with backend='nni' (NNI's SlimPruner "
            f"needs its own training loop); choose from {sorted(NNI_PRUNERS)}, or use "
            "backend='torch-pruning', which supports 'slim' (train with SlimRegularizer first)")
    pruning = import_nni_pruning()
    names = {id(module): name for name, module in model.named_modules()}
    excluded = sorted({names[id(sub)] for module in exclude for sub in module.modules()
                       if id(sub) in names and names[id(sub)]})
    work = copy.deepcopy(model)
    config_list = [{"op_types": ["Conv2d", "Linear"], "sparse_ratio": sparsity,
                    "exclude_op_names": excluded}]
    pruner = getattr(pruning, NNI_PRUNERS[prune_type])(work, config_list)
    _, masks = pruner.compress()
    pruner.unwrap_model()
    keep: Dict[str, torch.Tensor] = {}
    for name, targets in masks.items():
        weight_mask = targets.get("weight") if isinstance(targets, dict) else None
        if weight_mask is None:
            continue
        per_channel = weight_mask.detach().reshape(weight_mask.shape[0], -1).abs().sum(dim=1)
        keep[name] = (per_channel > 0).float().cpu()
    return keep


class MaskImportance:
    """torch-pruning channel scores from per-layer keep masks (e.g. NNI's).

    A channel's score is the fraction of the group's masked layers that keep it, plus a tie-break
    (below any vote difference) from ``fallback``, the L1 group importance by default.

    Args:
        keep_masks: ``{module name: 1/0 per output channel}``, as from :func:`nni_channel_masks`.
        model: The model being pruned (to map its modules to the names of ``keep_masks``).
        fallback: A torch-pruning importance used to break ties and to score groups that no
            mask covers; ``None`` for ``MagnitudeImportance(p=1)``.
    """

    def __init__(self, keep_masks: Dict[str, torch.Tensor], model: nn.Module,
                 fallback: Optional[Callable[..., Optional[torch.Tensor]]] = None) -> None:
        self.tp = import_torch_pruning()
        self.keep_masks = keep_masks
        self.names = {id(module): name for name, module in model.named_modules()}
        self.fallback = fallback or self.tp.importance.MagnitudeImportance(p=1)

    @torch.no_grad()
    def __call__(self, group: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        base = self.fallback(group, **kwargs)
        out_fns = (self.tp.prune_conv_out_channels, self.tp.prune_linear_out_channels)
        size = len(group[0].root_idxs)
        kept, votes = torch.zeros(size), torch.zeros(size)
        for i, (dep, idxs) in enumerate(group):
            mask = self.keep_masks.get(self.names.get(id(dep.layer), ""))
            if mask is None or dep.pruning_fn not in out_fns:
                continue
            pairs = [(r, j) for r, j in zip(group[i].root_idxs, idxs) if r is not None]
            if not pairs or len(mask) <= max(j for _, j in pairs):
                continue
            roots = torch.tensor([r for r, _ in pairs])
            kept.index_add_(0, roots, mask[torch.tensor([j for _, j in pairs])])
            votes.index_add_(0, roots, torch.ones(len(pairs)))
        if not bool((votes > 0).any()):
            return base
        score = kept / votes.clamp(min=1)
        if base is None:
            return score
        device = base.device
        base = base.detach().float().cpu()
        score = score + 1e-3 * base / (base.abs().max() + 1e-12)
        return score.to(device)
