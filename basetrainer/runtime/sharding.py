"""The ``strategy`` of a run (``ddp`` or ``fsdp``) and what a model sharded by FSDP2 needs
while it trains, saves and loads: its mesh, gradient sync inside accumulation windows, rank
0's buffers on every rank, state loaded by parameter name, and as many test forwards on every
rank.

Building and sharding the model: :mod:`basetrainer.runtime.fsdp_build`.
"""
import contextlib
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from basetrainer.runtime import comm
from basetrainer.runtime.errors import ConfigError

STRATEGIES = ("ddp", "fsdp")


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` is sharded by ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def strategy_of(cfg: Any) -> str:
    """The config's ``strategy`` (``ddp`` or ``fsdp``), checked."""
    value = str((cfg.get("strategy") if cfg is not None and hasattr(cfg, "get") else None) or "ddp").lower()
    if value not in STRATEGIES:
        raise ConfigError(f"config key 'strategy' = {value!r} must be one of {', '.join(STRATEGIES)} "
                          f"(ddp: every process holds the whole model; fsdp: parameters, gradients and "
                          f"optimizer state sharded over the processes)")
    return value


META_INIT = ("auto", "true", "false")


def meta_init(cfg: Any) -> Union[str, bool]:
    """The config's ``fsdp_meta_init``: ``"auto"`` (default), True or False, checked.

    Raises:
        ValueError: any other value (the key, the value and the choices are named).
    """
    value = cfg.get("fsdp_meta_init", "auto") if cfg is not None and hasattr(cfg, "get") else "auto"
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in META_INIT:
        return {"auto": "auto", "true": True, "false": False}[value.strip().lower()]
    raise ConfigError(f"config key 'fsdp_meta_init' = {value!r} must be auto, true or false (auto: ranks other "
                      f"than 0 build the model on the meta device, and normally where its constructor needs real "
                      f"values; true: always on meta; false: every rank builds the whole model)")


def check_config(cfg: Any, device: torch.device, amp: str) -> None:
    """The clear, early errors of ``strategy: fsdp``."""
    if strategy_of(cfg) != "fsdp":
        return
    meta_init(cfg)
    if amp == "fp16":
        raise ConfigError("amp: fp16 needs a GradScaler, which FSDP2 does not support: use amp: bf16 with "
                          "strategy: fsdp (or amp: fp16 with strategy: ddp)")
    if cfg.get("compile"):
        raise ConfigError("compile: true is not supported with strategy: fsdp here: set compile: false")
    if cfg.get("use_prune"):
        raise ConfigError("use_prune: true is not supported with strategy: fsdp (pruning needs the whole model on "
                          "every rank): prune with strategy: ddp or in one process, then train the pruned model "
                          "under fsdp")
    if not comm.is_dist():
        several = len(cfg.get("gpu_id") or []) > 1 and not cfg.get("distributed")
        raise ConfigError("strategy: fsdp shards the model over the processes of a process group, and none is "
                          "initialised" + (" (gpu_id with several GPUs and distributed: false is DataParallel, "
                                           "which cannot shard)" if several else "")
                          + ": start the script with distributed: true through launch(), torchrun or SLURM "
                            "(one process is allowed), or use strategy: ddp")


def mesh_of(model: nn.Module) -> Any:
    """The device mesh ``model``'s parameters are sharded over (None when they are not)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


def sync_gradients(model: nn.Module, sync: bool) -> Any:
    """A context for one micro-batch's backward: inside an accumulation window (``sync`` false)
    DDP skips its all-reduce (``no_sync``) and FSDP its reduce-scatter, keeping the unsharded
    gradients and parameters until the window's last micro-batch."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not sync:
        return model.no_sync()
    if is_fsdp(model):
        model.set_requires_gradient_sync(sync)
        model.set_reshard_after_backward(sync)
    return contextlib.nullcontext()


def buffer_sync(model: nn.Module) -> Optional[Callable[[], None]]:
    """A function that gives every rank rank 0's buffers (BatchNorm statistics), for the engine
    to call after each optimizer step, under ddp and fsdp; None where nothing needs it (one
    process, no buffers, or DDP built with ``broadcast_buffers=False``: the user's choice).

    Each rank's BatchNorm updates its statistics from its own share of the batch. DDP broadcasts
    rank 0's before each training forward, FSDP2 never (it shards parameters and leaves buffers
    alone), and neither before the test phase, which runs on the unwrapped module. So the ranks
    tested with statistics of their own and ModelEMA averaged different ones, while checkpoints
    and best files hold rank 0's: the test figure was no one model's (measured, 2 processes,
    ModelEMA: under ddp a 3-layer Conv+BatchNorm net's best file named 1.3870 evaluated to
    1.38693, against the epoch's 1.38696; under fsdp a Linear+BatchNorm net's two averages were
    0.21 apart). With this, every rank holds rank 0's buffers at each step's end, so a buffer is
    the same wherever it is read (the average, the test phase, a checkpoint, a resume); rank 0's
    own follow its share alone, as under DDP's broadcast.
    """
    if comm.get_world_size() == 1:
        return None
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if not model.broadcast_buffers:
            return None
        model = model.module
    elif not is_fsdp(model):
        return None
    if next(model.buffers(), None) is None:
        return None
    import torch.distributed as dist

    @torch.no_grad()
    def sync() -> None:   # one broadcast: every buffer's bytes (a collective's latency dominates)
        # each time (a module may replace a buffer); wider elements first, so that every part
        # of the bytes starts at a multiple of its element's size (viewable as its dtype)
        buffers = sorted(model.buffers(), key=lambda b: -b.element_size())
        flat = torch.cat([b.reshape(-1).view(torch.uint8) for b in buffers])
        dist.broadcast(flat, src=0)
        if comm.get_rank() != 0:
            parts = flat.split([b.numel() * b.element_size() for b in buffers])
            torch._foreach_copy_(buffers, [p.view(b.dtype).view(b.shape) for p, b in zip(parts, buffers)])

    return sync


def _by_name(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """An ``optimizer.state_dict()`` (parameters numbered) keyed by parameter name instead."""
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    for group, saved_group in zip(optimizer.param_groups, saved.get("param_groups", [])):
        fqns = [names[id(p)] for p in group["params"]]
        for index, fqn in zip(saved_group["params"], fqns):
            if index in saved.get("state", {}):
                state[fqn] = saved["state"][index]
        groups.append({**saved_group, "params": fqns})
    return {"state": state, "param_groups": groups}


def load_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], state: dict, full: bool) -> None:
    """Load a checkpoint's model and optimizer state by parameter name: sharded state (a
    sharded checkpoint's) or, with ``full``, whole tensors (a one-file checkpoint) into a model
    that is sharded or not."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=full, strict=True)
    set_model_state_dict(model, state["model"], options=options)
    if optimizer is not None and state.get("optimizer"):
        saved = state["optimizer"]
        groups = saved.get("param_groups") or [{}]
        if full and any(isinstance(i, int) for i in groups[0].get("params", [])):   # optimizer.state_dict()
            saved = _by_name(model, optimizer, saved)
        # a parameter that never had a gradient (an unused head) has no state: as load_state_dict
        set_optimizer_state_dict(model, optimizer, saved,
                                 options=StateDictOptions(full_state_dict=full, strict=False))


def most_test_batches(engine: Any) -> int:
    """FSDP: the most test batches any rank holds (asked before any test forward: every
    forward all-gathers with the other ranks). Other models: 0 (nothing to even out)."""
    if not is_fsdp(engine.model) or comm.get_world_size() == 1:
        return 0
    return max(comm.all_gather_object(len(engine.test_loader)))


def even_out_test_forwards(engine: Any, missing: int) -> None:
    """FSDP: every forward all-gathers parameters with the other ranks, and exact test sharding
    gives ranks different numbers of batches; a rank with fewer runs ``missing`` forwards of a
    placeholder batch (one sample of the data set, outputs unused), so all run as many."""
    if missing <= 0:
        return
    batch = None
    for loader in (engine.test_loader, engine.train_loader):
        dataset = getattr(loader, "dataset", None)
        if dataset is not None and len(dataset) and getattr(loader, "collate_fn", None) is not None:
            batch = engine.to_device(loader.collate_fn([dataset[0]]))
            break
    if batch is None:
        raise RuntimeError("strategy: fsdp: this rank has fewer test batches than the others and no sample "
                           "to run in their place (a data set without len() or collate_fn)")
    for _ in range(missing):
        with engine.autocast():
            engine.run_step(batch)
