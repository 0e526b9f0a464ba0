"""The training order: global batches from (seed, epoch), split over the ranks without padding,
and random draws per sample that depend only on (seed, epoch, sample).

:class:`GlobalBatchSampler` is a DataLoader ``batch_sampler``. Epoch e's permutation comes from
(seed, e) (the one ``DistributedSampler`` draws); global batch k is its k-th slice of
``batch_size`` samples (the last one smaller, or dropped with ``drop_last``), and rank r of W
takes ``batch[r::W]``. So every sample is trained on once per epoch over all ranks, the shares
of a batch differ by at most one sample, and step k of any world size sees the same global
batch. A rank whose share of the (last) batch is empty gets a *placeholder* (two copies of a
sample of that batch): it runs forward and backward like the others, as DDP needs, and its
loss weight is 0 (:meth:`GlobalBatchSampler.share`).

Each item is handed to the data set as ``(index, epoch)``; :class:`SeededDataset` seeds the
python, numpy and torch generators from (seed, epoch, index) before it loads the item, so random
augmentation draws the same for a sample whichever worker, batch or resumed run loads it.
"""
import random
from typing import Any, Iterator, List, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


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
    """

    def __init__(self, size: int, batch_size: int, world: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, with_epoch: bool = True) -> None:
        self.size, self.batch_size, self.world, self.rank = size, batch_size, world, rank
        self.shuffle, self.seed, self.drop_last, self.with_epoch = shuffle, seed, drop_last, with_epoch
        self.epoch = 0
        self._start = 0
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

    def order(self) -> List[int]:
        """This epoch's permutation of the data set."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def __iter__(self) -> Iterator[List[Any]]:
        order, start, self._start = self.order(), self._start, 0
        epoch, offset = self.epoch, start * self.batch_size
        for step in range(start, len(self)):
            batch = order[offset:offset + self.global_sizes[step]]
            offset += self.global_sizes[step]
            mine = batch[self.rank::self.world] or batch[:1] * 2   # empty share: a placeholder
            yield [(i, epoch) for i in mine] if self.with_epoch else mine


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed of (seed, epoch, index), well mixed (splitmix64 steps)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) * 0xBF58476D1CE4E5B9 + int(index)) & 0xFFFFFFFFFFFFFFFF
    for _ in range(2):
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x >> 1


class SeededDataset(Dataset):
    """``dataset`` whose items are loaded with the random generators seeded from (seed, epoch,
    index): give it ``(index, epoch)`` keys (a plain index is loaded as is). In the main process
    the generators' states are put back after each batch, so the training's own draws (dropout,
    ...) are not disturbed. Other attributes are the wrapped data set's.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def _load(self, key: Any) -> Any:
        if not isinstance(key, tuple):
            return self.dataset[key]
        index, epoch = key
        s = sample_seed(self.seed, epoch, index)
        torch.default_generator.manual_seed(s)
        random.seed(s)
        np.random.seed(s % 2 ** 32)
        return self.dataset[index]

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: List[Any]) -> List[Any]:
        if torch.utils.data.get_worker_info() is not None:   # a worker: its generators are its own
            return [self._load(k) for k in keys]
        saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            return [self._load(k) for k in keys]
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])
