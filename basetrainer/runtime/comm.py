"""Distributed helpers that degrade gracefully.

Every function returns the single-process answer when ``torch.distributed`` is not initialised,
so the same code runs in every mode and is testable on one CPU process. Each collective marks
itself in the stall watchdog's progress stamp (:mod:`basetrainer.runtime.watchdog`): its name
and sequence number while it waits, one more progress when it returns.
"""
import os
from typing import Any, List

import torch
import torch.distributed as dist

from basetrainer.runtime.watchdog import collective


def is_dist() -> bool:
    """True when a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_local_rank() -> int:
    """Rank of this process on its machine (``LOCAL_RANK``, set by launch, torchrun or SLURM)."""
    if not is_dist():
        return 0
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        if key in os.environ:
            return int(os.environ[key])
    return get_rank()


def is_main_process() -> bool:
    return get_rank() == 0


def synchronize() -> None:
    """Barrier across all processes (no-op in one process)."""
    if is_dist() and get_world_size() > 1:
        with collective("barrier"):
            dist.barrier()


def _reduce_device() -> torch.device:
    if is_dist() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all processes; returns a new tensor on the input's device."""
    if not is_dist() or get_world_size() == 1:
        return tensor
    device = tensor.device
    t = tensor.detach().to(_reduce_device(), copy=True)
    with collective("all_reduce_sum"):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.to(device)


def all_gather_object(obj: Any) -> List[Any]:
    """Gather a picklable object from every process (a one-element list in one process)."""
    if not is_dist() or get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * get_world_size()
    with collective("all_gather_object"):
        dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` on every process."""
    if not is_dist() or get_world_size() == 1:
        return obj
    box = [obj]
    with collective("broadcast_object"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def any_true(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (used for agreed decisions)."""
    if not is_dist() or get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=_reduce_device())
    with collective("any_true"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def get_device(gpu_id: Any = None) -> torch.device:
    """The device this process trains on.

    In a distributed run with CUDA: ``cuda:gpu_id[local_rank]``. Otherwise the first entry of
    ``gpu_id`` when CUDA is available, else the CPU. Validation of ``gpu_id`` (ids present, a
    warning when no CUDA exists) is done by :class:`~basetrainer.engine.trainer.EngineTrainer`.
    """
    ids = [] if gpu_id is None else ([gpu_id] if isinstance(gpu_id, int) else list(gpu_id))
    if not ids or not torch.cuda.is_available():
        return torch.device("cpu")
    if is_dist():
        local = get_local_rank()
        return torch.device("cuda", ids[local] if local < len(ids) else local)
    return torch.device("cuda", ids[0])
