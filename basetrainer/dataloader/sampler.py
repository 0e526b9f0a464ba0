"""The training order: global batches from (seed, epoch), split over the ranks without padding.

:class:`GlobalBatchSampler` is a DataLoader ``batch_sampler``. Epoch e's permutation comes from
(seed, e) (the one ``DistributedSampler`` draws); global batch k is its k-th slice of
``batch_size`` samples (the last one smaller, or dropped with ``drop_last``), and rank r of W
takes ``batch[r::W]``. So every sample is trained on once per epoch over all ranks, the shares
of a batch differ by at most one sample, and step k of any world size sees the same global
batch. A rank whose share of the (last) batch is empty gets a *placeholder* (two copies of a
sample of that batch): it runs forward and backward like the others, as DDP needs, and its
loss weight is 0 (:meth:`GlobalBatchSampler.share`).

Each item can be handed to the data set as ``(index, epoch)``, for
:class:`~basetrainer.dataloader.seeding.SeededDataset`, which seeds the random draws of each
sample from (seed, epoch, index).

With class balance (``resample``, a :class:`~basetrainer.dataloader.data_resample.ClassBalance`)
the epoch's order is its resampled list of (seed, epoch), which may hold a sample several times;
the k-th copy's key is ``(index, epoch + k * 2**32)``, so each copy draws its own augmentation.

A checkpoint taken inside an epoch holds :meth:`GlobalBatchSampler.plan` of it, and a resume
there is refused when this loader would order that epoch otherwise (a changed ``balance``,
``shuffle``, data set, batch size): the steps after it would come from another order than the
steps before it (:mod:`basetrainer.engine.resume`).
"""
import hashlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Sampler


class GlobalBatchSampler(Sampler):
    """Rank ``rank``'s share of each global batch, as lists of ``(index, epoch)`` (or indices).

    Args:
        size: samples in the data set.
        batch_size: the global batch (all ranks together).
        world: number of ranks; rank: this one.
        shuffle: a new permutation every epoch (else the data set's order).
        seed: the permutation of epoch e is drawn from ``seed + e``.
        drop_last: drop the last global batch when it is incomplete.
        with_epoch: yield ``(index, epoch)`` keys (for a :class:`SeededDataset`), else indices.
        resample: the class balance whose ``indices(epoch)`` is each epoch's order (its length is
            ``size``; ``shuffle`` is its own).
    """

    def __init__(self, size: int, batch_size: int, world: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, with_epoch: bool = True, resample: Any = None) -> None:
        if resample is not None and len(resample) != size:
            raise ValueError(f"resample draws {len(resample)} samples an epoch, the data set holds {size}")
        self.resample = resample
        self.size, self.batch_size, self.world, self.rank = size, batch_size, world, rank
        self.shuffle, self.seed, self.drop_last, self.with_epoch = shuffle, seed, drop_last, with_epoch
        self.epoch = 0
        self._start = 0
        self._plan: Optional[Tuple[int, Dict[str, Any]]] = None   # (epoch, plan(epoch)), computed once
        full, rest = divmod(size, batch_size)
        self.global_sizes: List[int] = [batch_size] * full + ([rest] if rest and not drop_last else [])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, step: int) -> None:
        """The next iteration starts at global batch ``step`` (a resume inside an epoch)."""
        self._start = step

    def __len__(self) -> int:
        return len(self.global_sizes)

    def share(self, step: int) -> Tuple[int, int]:
        """``(samples of this rank, samples of the global batch)`` of step ``step``."""
        n = self.global_sizes[step]
        return len(range(self.rank, n, self.world)), n

    def order(self, epoch: Optional[int] = None) -> List[int]:
        """Epoch ``epoch``'s (default: this epoch's) permutation of the data set (with class
        balance: its resampled list)."""
        epoch = self.epoch if epoch is None else epoch
        if self.resample is not None:
            return self.resample.indices(epoch)
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def plan(self, epoch: int) -> Dict[str, Any]:
        """What lays out epoch ``epoch``'s global batches, the same on every rank and world size:
        ``samples``, ``batch_size``, ``shuffle``, ``balance`` (``"none"`` without class balance),
        ``order``, a digest of the epoch's order (which the seed, the labels and any of those
        decide), and ``batches``, how many there are."""
        if self._plan is None or self._plan[0] != epoch:
            digest = hashlib.sha256(np.asarray(self.order(epoch), dtype=np.int64).tobytes()).hexdigest()[:16]
            balance = self.resample.balance if self.resample is not None else "none"
            self._plan = (epoch, {"samples": self.size, "batch_size": self.batch_size, "shuffle": self.shuffle,
                                  "balance": balance, "order": digest, "batches": len(self)})
        return dict(self._plan[1])

    def __iter__(self) -> Iterator[List[Any]]:
        order, start, self._start = self.order(), self._start, 0
        epoch, offset = self.epoch, start * self.batch_size
        keys = self.resample.keys(order, epoch) if self.resample is not None and self.with_epoch else None
        for step in range(start, len(self)):
            positions = range(offset, offset + self.global_sizes[step])
            offset += self.global_sizes[step]
            mine = positions[self.rank::self.world] or [positions[0]] * 2   # empty share: a placeholder
            if keys is not None:
                yield [keys[p] for p in mine]
            else:
                yield [(order[p], epoch) for p in mine] if self.with_epoch else [order[p] for p in mine]
