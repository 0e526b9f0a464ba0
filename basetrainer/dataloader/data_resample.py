"""Class-balanced resampling: each epoch draws a new list of samples whose class counts follow a
rule, as a function of (seed, epoch) only (the original's ``DataResample``, and the ``balance``
config key of the training loader).

The rule (``balance``), for classes of ``n_c`` samples and N samples in all: class c gets

- ``"mean"``: ``N / C`` samples (every class the same);
- ``"log"``: a share of N proportional to ``log(n_c) + 1``;
- ``"sqrt"``: a share proportional to ``sqrt(n_c)``;
- ``"y"``: ``n_c`` (the classes as they are; only the draw is new);

rounded to whole samples by the largest remainders (equal remainders: the lower class first),
so an epoch keeps N samples and the steps per epoch (and every LR schedule) stay the same.
Balancing strength: mean > log > sqrt > y. Within a class of ``n_c`` samples asked for ``t_c``,
every sample is taken ``t_c // n_c`` times and ``t_c % n_c`` of them, drawn without
replacement, once more: each sample of a class appears as often as any other, give or take one.

In training, :class:`~basetrainer.dataloader.sampler.GlobalBatchSampler` takes
:meth:`ClassBalance.indices` as the epoch's order, so DDP equals one process and a resume
inside an epoch continues it exactly. The k-th copy of a sample in an epoch (k >= 1) is loaded
with its random draws seeded as in epoch ``epoch + k * 2**32`` (:func:`copy_epoch`), so the
copies of an oversampled image are augmented differently.
"""
import logging
import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

BALANCES = ("mean", "log", "sqrt", "y")
CONFIG_CHOICES = ("none", "mean", "log", "sqrt")   # the ``balance`` config key
_COPY = 2 ** 32


def copy_epoch(epoch: int, copy: int) -> int:
    """The epoch a sample's ``copy``-th repeat in ``epoch`` is seeded as (copy 0: ``epoch``)."""
    return epoch + copy * _COPY


def class_targets(counts: Dict[int, int], balance: str, total: Optional[int] = None) -> Dict[int, int]:
    """Samples per class of an epoch under ``balance`` (see the module's rule); they add up to
    ``total`` (default: the sum of ``counts``)."""
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r}: choose from {list(BALANCES)}")
    classes = sorted(c for c, n in counts.items() if n > 0)
    total = sum(counts[c] for c in classes) if total is None else int(total)
    if balance == "y" and total == sum(counts[c] for c in classes):
        return {c: int(counts[c]) for c in classes}
    weight = {"mean": lambda n: 1.0, "log": lambda n: math.log(n) + 1.0, "sqrt": math.sqrt,
              "y": float}[balance]
    w = np.array([weight(counts[c]) for c in classes], dtype=np.float64)
    raw = total * w / w.sum()
    base = np.floor(raw).astype(np.int64)
    left = int(total - base.sum())
    order = sorted(range(len(classes)), key=lambda i: (-(raw[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return {c: int(b) for c, b in zip(classes, base)}


class ClassBalance:
    """The resampled index list of each epoch, a function of (seed, epoch).

    Args:
        labels: the class of every sample of the data set (ints).
        balance: ``"mean"``, ``"log"``, ``"sqrt"`` or ``"y"``.
        seed: the seed of the draws.
        shuffle: shuffle the epoch's list (else grouped by class, in index order).
    """

    def __init__(self, labels: Sequence[int], balance: str = "mean", seed: int = 0, shuffle: bool = True) -> None:
        y = _as_labels(labels)
        if balance not in BALANCES:
            raise ValueError(f"balance={balance!r}: choose from {list(BALANCES)}")
        self.balance, self.seed, self.shuffle = balance, int(seed), bool(shuffle)
        self.size = len(y)
        classes, counts = np.unique(y, return_counts=True)
        self.counts = {int(c): int(n) for c, n in zip(classes, counts)}
        self.members = {int(c): np.nonzero(y == c)[0] for c in classes}
        self.targets = class_targets(self.counts, balance, self.size)

    def __len__(self) -> int:
        return self.size

    def _generator(self, epoch: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed((self.seed * 1000003 + int(epoch) * 7919 + 104729) % 2 ** 63)
        return g

    def indices(self, epoch: int) -> List[int]:
        """Epoch ``epoch``'s list of sample indices (``len(self)`` of them)."""
        g = self._generator(epoch)
        parts = []
        for c in sorted(self.members):
            members, want = self.members[c], self.targets[c]
            whole, rest = divmod(want, len(members))
            picks = [members] * whole
            if rest:
                picks.append(np.sort(members[torch.randperm(len(members), generator=g)[:rest].numpy()]))
            if picks:
                parts.append(np.concatenate(picks))
        order = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if self.shuffle:
            order = order[torch.randperm(len(order), generator=g).numpy()]
        return order.tolist()

    def keys(self, order: List[int], epoch: int) -> List[tuple]:
        """``(index, seeded-as epoch)`` per entry of ``order``: copies after the first get
        :func:`copy_epoch` (their own random draws)."""
        seen: Dict[int, int] = {}
        out = []
        for i in order:
            k = seen.get(i, 0)
            seen[i] = k + 1
            out.append((i, copy_epoch(epoch, k)))
        return out


def _as_labels(labels: Sequence[int]) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ValueError(f"labels must be one class index per sample (a non-empty 1-D list); got shape {y.shape}")
    if not (np.issubdtype(y.dtype, np.integer) or (np.issubdtype(y.dtype, np.floating) and np.all(y == np.round(y)))):
        raise ValueError(f"labels must be integer class indices; got {y.dtype} values such as {y[:3].tolist()}")
    y = y.astype(np.int64)
    if y.min() < 0:
        raise ValueError(f"labels must be >= 0; sample {int(np.argmin(y))} has {int(y.min())}")
    return y


def labels_of(dataset: Any, labels: Optional[Sequence[int]] = None, key: str = "balance") -> np.ndarray:
    """The class of every sample of ``dataset``: ``labels`` when given, else the data set's
    ``targets`` (torchvision's ImageFolder, MNIST, CIFAR), the second tensor of a TensorDataset,
    those of a Subset's or ConcatDataset's parts.

    Raises:
        ValueError: none can be found (the fix named), or a count that is not the data set's.
    """
    if labels is None:
        labels = _find_labels(dataset)
    if labels is None:
        raise ValueError(f"{key}: class-balanced resampling needs the class of every training sample, and "
                         f"{type(dataset).__name__} does not say (no .targets, not a TensorDataset): pass "
                         f"labels=[...] to build_dataloader, or give the data set a .targets list")
    y = _as_labels(labels)
    if len(y) != len(dataset):
        raise ValueError(f"{key}: {len(y)} labels for a data set of {len(dataset)} samples: give one per sample")
    return y


def _find_labels(dataset: Any) -> Optional[Any]:
    from torch.utils.data import ConcatDataset, Subset, TensorDataset

    inner = getattr(dataset, "dataset", None)
    if type(dataset).__name__ == "SeededDataset" and inner is not None:
        return _find_labels(inner)
    targets = getattr(dataset, "targets", None)
    if targets is not None and len(targets) == len(dataset):
        return targets
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2:
        return dataset.tensors[1]
    if isinstance(dataset, Subset):
        parent = _find_labels(dataset.dataset)
        return None if parent is None else np.asarray(parent)[np.asarray(dataset.indices)]
    if isinstance(dataset, ConcatDataset):
        parts = [_find_labels(d) for d in dataset.datasets]
        return None if any(p is None for p in parts) else np.concatenate([np.asarray(p) for p in parts])
    return None


def epoch_resampler(dataset: Any, balance: Optional[str], labels: Optional[Sequence[int]] = None, seed: int = 0,
                    shuffle: bool = True, key: str = "balance") -> Optional[ClassBalance]:
    """The :class:`ClassBalance` of a training set for the ``balance`` key (None for none).

    Raises:
        ValueError: a ``balance`` not in :data:`CONFIG_CHOICES` (and ``"y"``), labels not found.
    """
    if balance is None or balance is False or (isinstance(balance, str) and balance.lower() == "none"):
        return None
    if not isinstance(balance, str) or balance.lower() not in BALANCES:
        raise ValueError(f"{key}={balance!r}: choose from {list(CONFIG_CHOICES)}")
    balancer = ClassBalance(labels_of(dataset, labels, key), balance.lower(), seed, shuffle)
    logger.info("class balance %r: %s samples per class and epoch (from %s)", balance, balancer.targets,
                balancer.counts)
    return balancer


class DataResample:
    """Resample ``item_list`` (e.g. ``(path, label)`` tuples) to balance its classes, anew each
    :meth:`update` (the original's API).

    Args:
        item_list: the items; ``item[label_index]`` is the class (an int, or a name: names are
            numbered in sorted order).
        label_index: where the class is in an item.
        balance: ``"mean"``, ``"log"``, ``"sqrt"`` or ``"y"`` (see the module's rule).
        shuffle: shuffle each resampled list.
        disp: log the class counts.
        seed: the draws are a function of (seed, the update's epoch).

    Example::

        resample = DataResample(items, label_index=1, balance="sqrt")
        for epoch in range(epochs):
            items_of_epoch = resample.update(shuffle=True)
    """

    def __init__(self, item_list: Optional[Sequence[Any]] = None, label_index: int = 1, balance: str = "mean",
                 shuffle: bool = True, disp: bool = False, seed: int = 0) -> None:
        self.src_item_list = list(item_list or [])
        if not self.src_item_list:
            raise ValueError("DataResample: item_list is empty")
        self.label_index, self.balance, self.shuffle, self.disp, self.seed = label_index, balance, shuffle, disp, seed
        raw = [item[label_index] for item in self.src_item_list]
        if all(isinstance(v, str) for v in raw):
            self.class_name = sorted(set(raw))
            raw = [self.class_name.index(v) for v in raw]
        else:
            self.class_name = None
        self.balancer = ClassBalance(raw, balance, seed, shuffle)
        self.class_count = dict(self.balancer.counts)
        self.balance_nums = dict(self.balancer.targets)
        self.class_weight = {c: len(self.src_item_list) / (len(self.class_count) * n) for c, n in self.class_count.items()}
        self.epoch = -1
        if disp:
            logger.info("DataResample %r: class counts %s -> %s per epoch", balance, self.class_count, self.balance_nums)
        self.item_list = self.update(shuffle=shuffle)

    def __len__(self) -> int:
        return len(self.item_list)

    def update(self, shuffle: Optional[bool] = None, epoch: Optional[int] = None) -> List[Any]:
        """A new resampled list (the next epoch's, or epoch ``epoch``'s): a function of
        (seed, epoch), so a resumed run gets the list it would have had."""
        self.epoch = self.epoch + 1 if epoch is None else int(epoch)
        if shuffle is not None:
            self.balancer.shuffle = bool(shuffle)
        self.item_list = [self.src_item_list[i] for i in self.balancer.indices(self.epoch)]
        return self.item_list
