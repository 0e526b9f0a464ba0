"""FSDP2 (``strategy: fsdp``): the model's blocks and root sharded over the processes.

Every process holds 1/world of the parameters, their gradients and the optimizer state; a
block's full parameters exist only while it runs (``torch.distributed.fsdp.fully_shard``).
Rank 0 builds the model as in a single-process run (so the initial weights are those of that
run), and after sharding its weights and buffers are scattered into every rank. The other ranks
first try to build it on the ``meta`` device (no memory, ``fsdp_meta_init: auto``); a constructor
that needs real values there (``tensor.item()``, ``.tolist()``, a plain tensor attribute) is built
again normally on that rank, with an info line saying why (:func:`construct`). Gradients are
averaged like DDP's, so the loss weighting of :mod:`basetrainer.engine.steps` makes an FSDP run
equal to the one-process run.
"""
import contextlib
import ctypes
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from basetrainer.runtime import comm

logger = logging.getLogger(__name__)

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
        raise ValueError(f"config key 'strategy' = {value!r} must be one of {', '.join(STRATEGIES)} "
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
    raise ValueError(f"config key 'fsdp_meta_init' = {value!r} must be auto, true or false (auto: ranks other "
                     f"than 0 build the model on the meta device, and normally where its constructor needs real "
                     f"values; true: always on meta; false: every rank builds the whole model)")


class BuildAttempt:
    """One building of the model under ``strategy: fsdp``, from :func:`construct` to
    :func:`shard`: the trainer makes it, gives it to :func:`construct` and, while the user's
    ``build_model`` runs, to :func:`shard` through ``build_model_parallel`` (its own field), so
    that what the build left for the sharding travels with the build, not as a process-wide
    flag a second trainer (or a build that never reached :func:`shard`) would find."""

    def __init__(self) -> None:
        self.on_meta = False                         # build_model is running on the meta device
        self.talking = False                         # shard() began its collectives: too late to build again
        self.normal_because: Optional[str] = None    # why this rank built normally (rank 0 reports it)


class _NotMetaSafe(RuntimeError):
    """A model built on meta that would fail later (a plain tensor attribute left on meta)."""


def construct(cfg: Any, build: Callable[[], nn.Module], attempt: Optional[BuildAttempt] = None) -> nn.Module:
    """``build()`` (the trainer's ``build_model``) where ``strategy: fsdp`` wants it.

    Rank 0, and every rank of other strategies, builds normally. With ``fsdp`` the other ranks
    build on the ``meta`` device (shapes only, no memory; their weights come from rank 0) as
    ``fsdp_meta_init`` says: ``auto`` tries meta and builds again normally when the constructor
    fails there (it read a tensor's value, as timm's drop-path rates do) or leaves a plain tensor
    attribute on meta; ``true`` makes that an error; ``false`` builds normally at once.

    ``attempt`` records the try (see :class:`BuildAttempt`); ``build`` gives the same object to
    :func:`shard`, which reads it (a fresh one when None: then :func:`shard` is not told).

    Raises:
        ValueError: ``fsdp_meta_init: true`` and the model cannot be built on meta.
    """
    if strategy_of(cfg) != "fsdp" or not comm.is_dist() or comm.get_rank() == 0:
        return build()
    mode = meta_init(cfg)
    attempt = attempt if attempt is not None else BuildAttempt()
    if mode is False:
        attempt.normal_because = "fsdp_meta_init: false"
        return build()
    try:
        attempt.on_meta = True
        with torch.device("meta"):
            return build()
    except Exception as e:
        if attempt.talking:   # failed after the ranks began sharding together: building again would desync
            raise
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if mode is True:
            raise ValueError(f"config key 'fsdp_meta_init' = true: rank {comm.get_rank()} could not build the "
                             f"model on the meta device ({reason}); its constructor needs real tensor values. Set "
                             f"fsdp_meta_init: auto (build normally where meta fails) or false (every rank builds "
                             f"the whole model), or make the constructor meta-safe") from e
    finally:
        attempt.on_meta = False
    attempt.normal_because = reason
    logger.info("strategy: fsdp: rank %d builds the model normally, not on the meta device (%s): it holds the "
                "whole model in host memory once while it is built. Its weights are still rank 0's. "
                "fsdp_meta_init: false skips the meta attempt", comm.get_rank(), reason)
    return build()


def _meta_attributes(model: nn.Module) -> List[str]:
    """Tensors on the meta device held as plain attributes (neither parameter nor buffer):
    sharding would never give them values."""
    found = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in values):
                found.append(f"{name}.{attr}" if name else attr)
    return found


def check_config(cfg: Any, device: torch.device, amp: str) -> None:
    """The clear, early errors of ``strategy: fsdp``."""
    if strategy_of(cfg) != "fsdp":
        return
    meta_init(cfg)
    if amp == "fp16":
        raise ValueError("amp: fp16 needs a GradScaler, which FSDP2 does not support: use amp: bf16 with "
                         "strategy: fsdp (or amp: fp16 with strategy: ddp)")
    if cfg.get("compile"):
        raise ValueError("compile: true is not supported with strategy: fsdp here: set compile: false")
    if cfg.get("use_prune"):
        raise ValueError("use_prune: true is not supported with strategy: fsdp (pruning needs the whole model on "
                         "every rank): prune with strategy: ddp or in one process, then train the pruned model "
                         "under fsdp")
    if not comm.is_dist():
        several = len(cfg.get("gpu_id") or []) > 1 and not cfg.get("distributed")
        raise ValueError("strategy: fsdp shards the model over the processes of a process group, and none is "
                         "initialised" + (" (gpu_id with several GPUs and distributed: false is DataParallel, "
                                          "which cannot shard)" if several else "")
                         + ": start the script with distributed: true through launch(), torchrun or SLURM "
                           "(one process is allowed), or use strategy: ddp")


def default_blocks(model: nn.Module) -> List[nn.Module]:
    """The model's repeated blocks: modules of a class that occurs at least twice, holds
    parameters and contains no other such module's parent (torchvision's BasicBlock /
    Bottleneck / InvertedResidual, a transformer's layers). Falls back to the root's children
    that hold parameters."""
    counts: dict = {}
    for m in model.modules():
        if m is not model and any(True for _ in m.parameters()) and _is_composite(m):
            counts[type(m)] = counts.get(type(m), 0) + 1
    repeated = {t for t, n in counts.items() if n >= 2}
    chosen = _outermost(model, lambda m: type(m) in repeated)
    if not chosen:
        chosen = [m for m in model.children() if any(True for _ in m.parameters())]
    return chosen


def _is_composite(m: nn.Module) -> bool:
    """A module made of other modules (a block), not a leaf layer or a plain container."""
    return any(True for _ in m.children()) and not isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict))


def _outermost(model: nn.Module, pick: Callable[[nn.Module], bool]) -> List[nn.Module]:
    """Modules ``pick`` accepts that lie inside no other accepted module, in module order."""
    found: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if pick(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def blocks_to_wrap(model: nn.Module, wrap: Optional[Sequence[str]] = None,
                   policy: Optional[Callable[[nn.Module], bool]] = None) -> List[nn.Module]:
    """The modules ``fully_shard`` wraps before the root: ``policy(module)`` when given, else
    the classes named in ``wrap`` (``fsdp_wrap``), else :func:`default_blocks`.

    Raises:
        ValueError: a name in ``wrap`` matches no module of the model.
    """
    if policy is not None:
        return _outermost(model, lambda m: bool(policy(m)))
    if wrap:
        names = [str(w) for w in wrap]
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in names if n not in present]
        if missing:
            raise ValueError(f"config key 'fsdp_wrap' = {names!r}: {missing} match no module class of the model "
                             f"(its classes: {', '.join(sorted(present))}); name classes it has, or leave "
                             f"fsdp_wrap empty for its repeated blocks")
        return _outermost(model, lambda m: type(m).__name__ in names)
    return default_blocks(model)


def _mixed_precision(amp: str, device: torch.device) -> Any:
    if amp != "bf16":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # gloo cannot reduce bf16: the gradients are reduced in float32 on the CPU (and on GPUs,
    # where float32 reduction is also the more exact choice)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _running_stat_norms(model: nn.Module) -> List[nn.Module]:
    """The normalisation layers with running statistics (BatchNorm, SyncBatchNorm, GlobalBatchNorm,
    InstanceNorm with ``track_running_stats``) that :func:`shard` keeps in float32 under ``amp:
    bf16``, as FSDP1 did by default (``_module_classes_to_ignore_mixed_precision``) and FSDP2 does
    not: with its parameters cast to bf16 beside float32 running statistics, ``batch_norm``
    refuses to run ("expected scalar type BFloat16 but found Float"), so any BatchNorm model
    failed at its first forward. A bf16 input beside float32 parameters is fine (autocast does
    the same under ddp), and the output stays bf16. Each becomes an FSDP group of its own (two
    small collectives per step each), or keeps the group it has as a block."""
    return [m for m in model.modules() if m is not model and _tracks_running_stats(m)]


def _tracks_running_stats(module: nn.Module) -> bool:
    """A normalisation layer with running statistics: BatchNorm, SyncBatchNorm, InstanceNorm with
    ``track_running_stats`` (their public flag and buffer, not torch's private base class)."""
    return bool(getattr(module, "track_running_stats", False)) and isinstance(getattr(module, "running_mean", None),
                                                                                  torch.Tensor)


def shard(model: nn.Module, device: torch.device, cfg: Any,
          policy: Optional[Callable[[nn.Module], bool]] = None, attempt: Optional[BuildAttempt] = None) -> nn.Module:
    """``fully_shard`` the model's blocks and its root over all processes; the weights are rank
    0's (scattered from it: the other ranks built the model on ``meta``).

    Options from ``cfg``: ``fsdp_wrap`` (class names), ``reshard_after_forward`` (default
    true: free a block's full parameters after its forward, all-gather again in the backward),
    ``activation_checkpointing`` (recompute the wrapped blocks' activations in the backward),
    ``amp: bf16`` (bf16 compute, float32 gradient reduction). ``attempt``: the
    :class:`BuildAttempt` of the :func:`construct` this runs inside, if any (every rank calls
    this; rank 0 reports the ranks that built normally).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    amp = str(cfg.get("amp") or "none").lower()
    if attempt is not None and attempt.on_meta:
        plain = _meta_attributes(model)
        if plain:   # before any collective: construct() can still build again
            raise _NotMetaSafe(f"plain tensor attributes {plain[:5]} stay on the meta device (sharding gives "
                               f"values to parameters and buffers only; register them as buffers)")
    if device.type == "cpu":
        _return_freed_blocks()
    blocks = blocks_to_wrap(model, cfg.get("fsdp_wrap") or None, policy)
    ties = _tied(model, blocks)
    shared_buffers = _shared_buffers(model)
    full = _full_weights(model) if comm.get_rank() == 0 else None
    model.to(torch.device("meta"))   # rank 0 too: the weights come back as shards, one tensor at a time
    _retie(model, ties)              # .to() made one parameter of each name
    _retie_buffers(model, shared_buffers)
    if cfg.get("activation_checkpointing"):
        _checkpoint_activations(model, blocks)
    if attempt is not None:
        attempt.talking = True
    _report_normal_builds(attempt.normal_because if attempt is not None else None)
    mesh = init_device_mesh(device.type, (comm.get_world_size(),))
    options = dict(mesh=mesh, reshard_after_forward=bool(cfg.get("reshard_after_forward", True)))
    policy_mp = _mixed_precision(amp, device)
    if policy_mp is not None:
        options["mp_policy"] = policy_mp
    norms = _running_stat_norms(model) if policy_mp is not None else []
    if norms:   # each a group of its own, in float32
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # the input as autocast leaves it (bf16), as BatchNorm gets it under ddp
        in_float32 = {**options, "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)}
        for norm in norms:
            if not any(norm is block for block in blocks):
                fully_shard(norm, **in_float32)
    for block in blocks:
        fully_shard(block, **(in_float32 if any(block is norm for norm in norms) else options))
    fully_shard(model, **options)
    model.to_empty(device=device)
    _retie_buffers(model, shared_buffers)   # to_empty made one buffer of each name
    _scatter_from_rank0(model, full, device)
    return model


def _report_normal_builds(because: Optional[str]) -> None:
    """Rank 0 says which ranks built the whole model instead of on meta, and why (``because``:
    this rank's reason; the others log warnings only)."""
    reasons = comm.all_gather_object(because) if comm.get_world_size() > 1 else [None]
    built = {rank: why for rank, why in enumerate(reasons) if rank > 0 and why}
    if built and comm.get_rank() == 0:
        first = next(iter(built.values()))
        logger.info("strategy: fsdp: rank(s) %s built the whole model, not on the meta device (%s); the weights "
                    "are rank 0's. See fsdp_meta_init", sorted(built), first)


MMAP_THRESHOLD = 1 << 20


def _return_freed_blocks() -> None:
    """On the CPU, have glibc give blocks of 1 MiB and more back to the system when freed.

    FSDP all-gathers and frees each block's parameters and gradients at every step. glibc's
    mmap threshold, by default, rises to the size of each large block freed (up to 32 MiB), so
    those blocks then come from the heap, which fragments and keeps them: measured with
    bench/bench_fsdp.py (50 M parameters, AdamW, 2 processes), fsdp's peak RSS was 1.45x ddp's
    instead of the 0.5x sharding gives. A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, as
    the environment variable ``MALLOC_MMAP_THRESHOLD_`` does) keeps it flat. A threshold the
    user set in the environment is left alone; other C libraries are left alone.
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)   # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        logger.debug("mallopt is not available: glibc's mmap threshold left as it is")


def _tied(model: nn.Module, blocks: List[nn.Module]) -> List[List[str]]:
    """Names of the parameters shared by several modules (tied weights), one list per
    parameter; each must lie in one sharded unit (one block, or outside every block).

    Raises:
        ValueError: a parameter is shared by two blocks, or by a block and the rest of the model.
    """
    groups: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    block_names = {id(m): n for n, m in model.named_modules() if any(m is b for b in blocks)}
    prefixes = sorted(block_names.values(), key=len, reverse=True)
    ties = [names for names in groups.values() if len(names) > 1]
    for names in ties:
        units = {next((p for p in prefixes if n.startswith(p + ".")), "<root>") for n in names}
        if len(units) > 1:
            raise ValueError(f"strategy: fsdp: the parameters {names} are one tied parameter shared by "
                             f"{sorted(units)}, which are sharded separately; choose blocks that keep it in "
                             f"one of them (fsdp_wrap or wrap_policy), or untie it")
    return ties


def _retie(model: nn.Module, ties: List[List[str]]) -> None:
    for names in ties:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, shared)


def _shared_buffers(model: nn.Module) -> List[List[str]]:
    """Names of the buffers registered in several modules (one mask or positional table in
    every block), one list per buffer. Buffers are not sharded, so any placement is fine."""
    groups: Dict[int, List[str]] = {}
    for name, buf in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(buf), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie_buffers(model: nn.Module, shared: List[List[str]]) -> None:
    """Make every name of a shared buffer hold one tensor again (``.to()`` and ``to_empty``
    give each module its own copy)."""
    for names in shared:
        tensor = model.get_buffer(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            # assigning a tensor to a buffer's name replaces the buffer (nn.Module.__setattr__),
            # persistent or not as it was registered
            setattr(model.get_submodule(owner) if owner else model, attr, tensor)


def _full_weights(model: nn.Module) -> Tuple[dict, dict]:
    """Rank 0's ``state_dict()`` and its non-persistent buffers by name (those no state_dict
    holds), before sharding replaces them."""
    return ({k: v.detach() for k, v in model.state_dict().items()},
            {name: buf.detach() for name, buf in _non_persistent_buffers(model)})


def _non_persistent_buffers(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The buffers ``state_dict()`` leaves out (registered with ``persistent=False``), each
    tensor once (under its first name)."""
    saved = set(model.state_dict(keep_vars=True))
    return [(name, buf) for name, buf in model.named_buffers() if name not in saved]


def _scatter_from_rank0(model: nn.Module, full: Optional[Tuple[dict, dict]], device: torch.device) -> None:
    """Give every rank rank 0's weights: what ``state_dict()`` holds through torch's
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` (each rank keeps
    its shard of every parameter, and the buffers), and the non-persistent buffers by a
    broadcast here: torch's function loads a state_dict only, and measured without this step
    the ``pos`` table of tests/test_fsdp_defects.py's SharedBufferNet (registered with
    ``persistent=False``) stayed as ``to_empty`` left it, 2e17 from the one-process weights."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state, others = full if full is not None else ({}, {})
    # the other ranks run this inside construct()'s torch.device("meta"): the library makes
    # tensors without a device (shard offsets), which would land on meta
    with torch.device(device):
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, buf in _non_persistent_buffers(model):
            if full is not None:
                buf.copy_(others[name].to(device))
            if comm.get_world_size() > 1:
                dist.broadcast(buf, src=0)


def _checkpoint_activations(model: nn.Module, blocks: List[nn.Module]) -> None:
    """Recompute each block's activations in the backward instead of keeping them (torch's
    composable ``checkpoint``: parameter names stay as they are). The recomputation runs the
    block's forward again in train mode, where BatchNorm updates its running statistics a second
    time (num_batches_tracked 10 after 5 steps; resnet18's running means 1.13 from a run without
    checkpointing): it leaves them as the forward left them (:class:`_RunningStatsKept`)."""
    from torch.distributed._composable import checkpoint

    for block in blocks:
        norms = [m for m in block.modules() if _tracks_running_stats(m)]
        if norms:
            checkpoint(block, context_fn=lambda norms=norms: (contextlib.nullcontext(), _RunningStatsKept(norms)))
        else:
            checkpoint(block)


class _RunningStatsKept:
    """The context of a block's recomputation: its norms' running statistics (and batch counts)
    are put back as they were before it."""

    def __init__(self, norms: List[nn.Module]) -> None:
        self.norms = norms
        self.saved: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def _stats(self) -> List[torch.Tensor]:
        return [b for m in self.norms for b in (m.running_mean, m.running_var, m.num_batches_tracked)
                if isinstance(b, torch.Tensor)]

    def __enter__(self) -> "_RunningStatsKept":
        with torch.no_grad():
            self.saved = [(b, b.clone()) for b in self._stats()]
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for live, before in self.saved:
                live.copy_(before)
        self.saved = []


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
