"""DataLoaders for every mode: the global batch split over the processes, seeded order.

Training uses a :class:`~basetrainer.dataloader.sampler.GlobalBatchSampler` in every mode (one
rank in one process): global batches from a (seed, epoch) permutation, each split over the
ranks without padding, so step k of a single, DP or DDP run sees the same global batch, and
every sample is trained on once per epoch. Items are loaded with their random generators seeded
from (seed, epoch, index) (:class:`~basetrainer.dataloader.seeding.SeededDataset`).
Evaluation shards the data without padding or duplicates (:class:`ShardSampler`).
"""
import logging
import random
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from basetrainer.dataloader import data_resample
from basetrainer.dataloader.sampler import GlobalBatchSampler
from basetrainer.dataloader.seeding import SeededDataset
from basetrainer.runtime import comm, worker_watch
from basetrainer.runtime.errors import ConfigError

logger = logging.getLogger(__name__)


class ShardSampler(Sampler):
    """Indices ``rank, rank + world, ...``: disjoint shards that cover the data set (its first
    ``size`` samples when given) exactly once."""

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, size: Optional[int] = None) -> None:
        self.num_samples_total = len(dataset) if size is None else size
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples_total, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples_total, self.num_replicas))


class _WorkerSeeder:
    """Seeds python and numpy in each worker from torch's per-worker seed (which differs per
    rank, worker and epoch, and follows the loader's seeded generator)."""

    def __init__(self, user_fn: Any = None, stall: Optional[Tuple[float, str, int]] = None) -> None:
        self.user_fn = user_fn
        self.stall = stall   # (stall_timeout, report folder, rank): the worker's stall watch

    def __call__(self, worker_id: int) -> None:
        import numpy as np

        if self.stall is not None:
            worker_watch.WorkerWatch(*self.stall, worker_id=worker_id).start()

        seed = torch.initial_seed() % 2 ** 32
        random.seed(seed)
        np.random.seed(seed)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def build_dataloader(dataset: Dataset, batch_size: int, num_workers: int = 0, phase: str = "train",
                     shuffle: bool = True, pin_memory: bool = False, drop_last: bool = False,
                     distributed: Optional[bool] = None, seed: int = 2020, seed_per_sample: bool = True,
                     balance: Optional[str] = None, labels: Optional[Any] = None,
                     stall_watch: Optional[Tuple[float, str, int]] = None, **kwargs: Any) -> DataLoader:
    """See :meth:`basetrainer.engine.trainer.EngineTrainer.build_dataloader`."""
    if phase not in ("train", "test"):
        raise ValueError(f"phase={phase!r} must be 'train' or 'test'")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer (the global batch)")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers={num_workers!r} must be an integer >= 0")
    try:
        size = len(dataset)
    except TypeError:
        raise TypeError("build_dataloader needs a map-style dataset with __len__") from None
    if size == 0:
        raise ValueError(f"the {phase} dataset is empty: check the {phase}_data folder/files")
    sharded = comm.is_dist() and comm.get_world_size() > 1 and distributed is not False
    world, rank = (comm.get_world_size(), comm.get_rank()) if sharded else (1, 0)
    if comm.is_dist() and not sharded and phase == "train" and comm.get_world_size() > 1:
        logger.warning("build_dataloader(distributed=False) in a %d-process run: every process "
                       "iterates the whole training set", comm.get_world_size())
    if batch_size < world:
        raise ConfigError(f"batch_size={batch_size} is smaller than the number of processes ({world}); "
                         f"batch_size is the global batch: use at least {world}")
    generator = torch.Generator()
    generator.manual_seed(seed + 1000003 * rank)
    persistent = kwargs.pop("persistent_workers", num_workers > 0)
    common = dict(num_workers=num_workers, pin_memory=pin_memory, generator=generator,
                  worker_init_fn=_WorkerSeeder(kwargs.pop("worker_init_fn", None), stall_watch),
                  persistent_workers=persistent and num_workers > 0, **kwargs)
    if balance not in (None, "none") and phase != "train":
        raise ValueError(f"balance={balance!r} resamples the training set; the {phase} loader takes balance=None")
    if phase == "test":   # drop_last: the incomplete *global* batch, as one process would
        kept = size // batch_size * batch_size if drop_last else size
        if kept == 0:
            raise ConfigError(f"batch_size={batch_size} is larger than the test set ({size} samples) with "
                             f"drop_last=True: nothing would be evaluated. Lower batch_size or set drop_last=False")
        return DataLoader(dataset, batch_size=max(1, batch_size // world), drop_last=False,
                          sampler=ShardSampler(dataset, num_replicas=world, rank=rank, size=kept), **common)
    resample = data_resample.epoch_resampler(dataset, balance, labels, seed, shuffle)   # None: no class balance
    batches = GlobalBatchSampler(size, batch_size, world=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last, with_epoch=seed_per_sample, resample=resample)
    if len(batches) == 0:
        raise ConfigError(f"batch_size={batch_size} is larger than the training set ({size} samples) "
                         f"with drop_last=True: no batch would be made. Lower batch_size or set drop_last=False")
    if seed_per_sample:
        dataset = SeededDataset(dataset, seed)
    return DataLoader(dataset, batch_sampler=batches, **common)


def check_test_shards(loader: Any, what: str) -> None:
    """Raise unless ``loader`` gives every process a disjoint share of the samples one process
    would evaluate, so that figures summed (or gathered) over the ranks count each sample once:
    in one process any loader but a sampler sharded for another number of processes; in W
    processes a :class:`ShardSampler` (``build_dataloader(..., phase="test")``) or a
    DistributedSampler that does not pad, for this rank of W, batched by a plain BatchSampler
    that keeps each rank's last batch.

    Raises:
        ValueError: naming ``what``, why samples would count twice or not at all, and the fix.
    """
    world, rank = (comm.get_world_size(), comm.get_rank()) if comm.is_dist() else (1, 0)
    sampler, batches = getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)
    fix = ("pass the data set itself (its test loader is built for you), or build the loader with "
           "build_dataloader(dataset, batch_size, phase='test')")
    sharded = isinstance(sampler, (DistributedSampler, ShardSampler))
    if isinstance(sampler, DistributedSampler) and sampler.total_size != len(sampler.dataset):
        size = len(sampler.dataset)
        raise ValueError(f"{what}: its DistributedSampler {'pads' if sampler.total_size > size else 'cuts'} {size} "
                         f"samples to {sampler.total_size}, so the figures would count samples twice or leave some "
                         f"out: {fix}")
    if sharded and (sampler.num_replicas, sampler.rank) != (world, rank):
        raise ValueError(f"{what}: its {type(sampler).__name__} is shard {sampler.rank} of {sampler.num_replicas}, and "
                         f"this is process {rank} of {world}, so samples would count twice or not at all: {fix}")
    if world == 1:
        return
    why = None
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        why = "iterates an IterableDataset, whose streams in the processes may overlap"
    elif batches is not None and type(batches) is not BatchSampler:
        why = (f"batches samples with a {type(batches).__name__}, whose shares in the processes cannot be "
               f"checked to be disjoint")
    elif batches is not None and batches.drop_last:
        why = "drops each process's last incomplete batch, so the samples left out differ from one process's"
    elif not sharded:
        why = (f"draws samples with a {type(sampler).__name__}, which is not sharded over the processes: each "
               f"would evaluate the whole data set (or a share that may overlap the others'), counting samples "
               f"up to {world} times")
    if why is not None:
        raise ValueError(f"{what}: the loader {why} in this {world}-process run: {fix}")


def check_equal_lengths(loader: Any) -> None:
    """In a distributed run, every rank must see the same number of train batches, or DDP
    hangs at the first step one rank does not take: compare them up front (loaders made by
    :func:`build_dataloader` always agree)."""
    if not comm.is_dist() or comm.get_world_size() == 1:
        return
    lengths = comm.all_gather_object(len(loader))
    if len(set(lengths)) > 1:
        raise RuntimeError(f"ranks have different numbers of train batches {lengths}: DDP would hang. "
                           f"Use build_dataloader (every rank takes a share of every global batch) "
                           f"or give every rank the same number of batches")


def epoch_plan(loader: Any, epoch: int) -> Dict[str, Any]:
    """What lays out epoch ``epoch`` of a train loader made by :func:`build_dataloader`
    (:meth:`GlobalBatchSampler.plan`); ``{}`` for a loader of another kind (nothing known)."""
    batches = getattr(loader, "batch_sampler", None)
    return batches.plan(epoch) if isinstance(batches, GlobalBatchSampler) else {}


def set_epoch(loader: Any, epoch: int, seed: int, rank: int) -> None:
    """Tell ``loader``'s (distributed) samplers which epoch it is, so they reshuffle, and seed
    its worker generator from (seed, epoch, rank)."""
    batches = getattr(loader, "batch_sampler", None)
    done: list = []  # a DataLoader's batch_sampler usually wraps its sampler: call each once
    for sampler in (getattr(loader, "sampler", None), batches, getattr(batches, "sampler", None)):
        if hasattr(sampler, "set_epoch") and not any(sampler is s for s in done):
            sampler.set_epoch(epoch)
            done.append(sampler)
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator):
        generator.manual_seed((int(seed) * 1000003 + epoch * 7919 + rank) % 2 ** 63)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False, channels_last: bool = False) -> Any:
    """``batch`` (tensors in tuples, named tuples, lists and dicts) on ``device``; 4-D float
    tensors in the channels-last memory format when ``channels_last``."""
    if device.type == "cpu" and not channels_last and not torch.cuda.is_initialized():
        return batch   # no tensor can be anywhere but on the CPU: nothing to move (a few us a step)
    if isinstance(batch, torch.Tensor):
        if channels_last and batch.dim() == 4 and batch.is_floating_point():
            return batch.to(device, non_blocking=non_blocking, memory_format=torch.channels_last)
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device, non_blocking, channels_last) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking, channels_last) for v in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking, channels_last) for k, v in batch.items()}
    return batch
