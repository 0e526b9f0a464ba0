"""FSDP2 (``strategy: fsdp``): the model built and its blocks and root sharded over the processes.

Every process holds 1/world of the parameters, their gradients and the optimizer state; a
block's full parameters exist only while it runs (``torch.distributed.fsdp.fully_shard``).
Rank 0 builds the model as in a single-process run (so the initial weights are those of that
run), and after sharding its weights and buffers are scattered into every rank
(:mod:`basetrainer.runtime.fsdp_weights`). The other ranks first try to build it on the ``meta``
device (no memory, ``fsdp_meta_init: auto``); a constructor that needs real values there
(``tensor.item()``, ``.tolist()``, a plain tensor attribute) is built again normally on that
rank, with an info line saying why (:func:`construct`). Gradients are averaged like DDP's, so
the loss weighting of :mod:`basetrainer.engine.steps` makes an FSDP run equal to the
one-process run. The strategy's config and what the sharded model needs while training:
:mod:`basetrainer.runtime.sharding`.
"""
import contextlib
import ctypes
import logging
import os
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from basetrainer.runtime import comm, fsdp_weights
from basetrainer.runtime.sharding import meta_init, strategy_of

logger = logging.getLogger(__name__)


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
    ties = fsdp_weights.tied(model, blocks)
    shared_buffers = fsdp_weights.shared_buffers(model)
    full = fsdp_weights.full_weights(model) if comm.get_rank() == 0 else None
    model.to(torch.device("meta"))   # rank 0 too: the weights come back as shards, one tensor at a time
    fsdp_weights.retie(model, ties)              # .to() made one parameter of each name
    fsdp_weights.retie_buffers(model, shared_buffers)
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
    fsdp_weights.retie_buffers(model, shared_buffers)   # to_empty made one buffer of each name
    fsdp_weights.scatter_from_rank0(model, full, device)
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
