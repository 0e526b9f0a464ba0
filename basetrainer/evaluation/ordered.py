"""Per-sample outputs of every rank, put back in dataset order: no padding duplicate, no sample
missing, the bytes unchanged.

The test loader (:func:`~basetrainer.dataloader.loader.build_dataloader` with ``phase="test"``)
shards a data set of N samples with a
:class:`~basetrainer.dataloader.loader.ShardSampler`: rank r of W holds samples
``r, r + W, r + 2W, ...`` in that order, so the j-th output of rank r is sample ``j * W + r``,
and the shards' lengths differ by at most one (the lower ranks hold the extra ones).
:func:`interleave` inverts that; :func:`gather_ordered` gathers the shards (a collective) and
interleaves them.

For outputs too large to hold, :class:`OrderedCollector` works round by round: in round k every
rank gives its k-th batch (``None`` once it has none left). The k-th batches of all ranks are
the consecutive samples ``[k * b * W, (k + 1) * b * W)`` (b = the per-rank batch), so each round
yields the next block of rows in dataset order, which a writer
(:mod:`basetrainer.evaluation.writers`) can stream to a file on the main process.

Outputs may be a tensor, a numpy array, or tuples, lists and dicts of them (one row per sample
in each); :func:`flatten` names them (``output``; ``0``, ``1``... for a tuple; the keys of a dict;
``a.b`` when nested).
"""
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from basetrainer.runtime import comm

# ----------------------------------------------------------------------------- structure
def flatten(outputs: Any, prefix: str = "") -> Tuple["OrderedDict[str, torch.Tensor]", Any]:
    """``(named, spec)``: the tensors of ``outputs`` by name (numpy arrays as tensors on the
    CPU, sharing memory), and the structure to rebuild it with :func:`unflatten`.

    Raises:
        TypeError: a leaf that is neither a tensor nor a numpy array.
        ValueError: leaves with different numbers of rows (one row per sample is required).
    """
    named: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    spec = _flatten(outputs, prefix, named)
    if not named:
        raise ValueError("the outputs hold no tensor: give a tensor, an array, or tuples/dicts of them")
    rows = {name: t.shape[0] if t.dim() else None for name, t in named.items()}
    if len(set(rows.values())) > 1 or None in rows.values():
        raise ValueError(f"every output must hold one row per sample (its first dimension); got "
                         f"{rows} samples by output")
    return named, spec


def _flatten(value: Any, name: str, named: Dict[str, torch.Tensor]) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        key = name or "output"
        if key in named:
            raise ValueError(f"two outputs are both named {key!r} (a key with a dot and a nested dict?)")
        is_array = isinstance(value, np.ndarray)
        named[key] = torch.from_numpy(np.ascontiguousarray(value)) if is_array else value.detach()
        return ("tensor", key, is_array)
    if isinstance(value, dict):
        return ("dict", [(k, _flatten(v, _join(name, _key(k)), named)) for k, v in value.items()])
    if isinstance(value, (tuple, list)):
        base = name or "output"
        return ("tuple" if isinstance(value, tuple) else "list",
                [_flatten(v, _join(base, str(i)), named) for i, v in enumerate(value)])
    raise TypeError(f"an output of type {type(value).__name__} (at {name or 'the top'!r}) cannot be gathered: "
                    f"outputs must be tensors or numpy arrays, in tuples, lists or dicts (str keys)")


def _key(k: Any) -> str:
    if not isinstance(k, str):
        raise TypeError(f"output dict keys must be str, got {k!r} ({type(k).__name__})")
    return k


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def unflatten(named: Dict[str, Any], spec: Any) -> Any:
    """The structure :func:`flatten` took apart, with the values of ``named``."""
    kind = spec[0]
    if kind == "tensor":
        value = named[spec[1]]
        return value.numpy() if spec[2] and isinstance(value, torch.Tensor) else value
    if kind == "dict":
        return {k: unflatten(named, s) for k, s in spec[1]}
    items = [unflatten(named, s) for s in spec[1]]
    return tuple(items) if kind == "tuple" else items


def signature(named: Dict[str, torch.Tensor]) -> List[Tuple[str, str, Tuple[int, ...]]]:
    """What must agree between chunks: names, dtypes and the shape of one row."""
    return [(k, str(t.dtype), tuple(t.shape[1:])) for k, t in named.items()]


# ----------------------------------------------------------------------------- interleave
def check_shard_lengths(lengths: Sequence[int]) -> None:
    """Raise unless ``lengths`` are those of a ShardSampler's shards (non-increasing by rank,
    at most one apart)."""
    if any(b > a for a, b in zip(lengths, lengths[1:])) or (lengths and lengths[0] - lengths[-1] > 1):
        raise ValueError(f"shards of lengths {list(lengths)} are not a ShardSampler's (rank r holds samples "
                         f"r, r+W, ...; lengths non-increasing by rank and at most one apart): build the "
                         f"test loader with build_dataloader(..., phase='test')")


def interleave(shards: Sequence[Any]) -> Any:
    """Rows of rank r's shard ``shards[r]`` (tensors or numpy arrays) put back at dataset
    positions ``j * W + r``.

    Raises:
        ValueError: lengths that are not a ShardSampler's, or rows of different shapes/dtypes.
    """
    world = len(shards)
    if world == 0:
        raise ValueError("interleave needs at least one shard")
    check_shard_lengths([len(s) for s in shards])
    first = shards[0]
    rows = {(tuple(s.shape[1:]), str(s.dtype)) for s in shards}
    if len(rows) > 1:
        raise ValueError(f"the ranks' outputs differ in row shape or dtype: {sorted(rows)}")
    total = sum(len(s) for s in shards)
    if world == 1:
        return first
    if isinstance(first, np.ndarray):
        out = np.empty((total,) + first.shape[1:], dtype=first.dtype)
    else:
        out = first.new_empty((total,) + tuple(first.shape[1:]))
    for r, shard in enumerate(shards):
        out[r::world] = shard
    return out


# ----------------------------------------------------------------------------- collectives
def _device() -> torch.device:
    if comm.is_dist() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_named(named: Optional[Dict[str, torch.Tensor]], dst: Optional[int], sig: Optional[list] = None,
                  spec: Any = None) -> Tuple[Optional[List[Optional[Dict[str, torch.Tensor]]]], Any]:
    """Every rank's ``named`` (None from a rank with nothing), as a list by rank, on every rank
    (``dst=None``) or on ``dst`` only (None elsewhere). One object gather for the shapes, then
    one tensor gather per output: the bytes travel unchanged. Also returns the structure (the
    first giving rank's ``spec``)."""
    world = comm.get_world_size()
    mine = None if named is None else (signature(named), len(next(iter(named.values()))), spec)
    infos = comm.all_gather_object(mine)
    given = [i for i in infos if i is not None]
    receive = dst is None or comm.get_rank() == dst
    if not given:
        return ([None] * world if receive else None), None
    sigs = {repr(i[0]) for i in given} | ({repr(sig)} if sig is not None else set())
    if len(sigs) > 1:
        raise ValueError(f"the ranks' outputs differ in structure, dtype or row shape: {sorted(sigs)}")
    names = given[0][0]
    lengths = [0 if i is None else i[1] for i in infos]
    most = max(lengths)
    device = _device()
    gathered: List[Dict[str, torch.Tensor]] = [dict() for _ in range(world)]
    for name, dtype, row in names:
        dt = getattr(torch, dtype.split(".")[-1])
        if named is not None:
            t = named[name]
            padded = t.to(device) if len(t) == most else torch.cat(
                [t.to(device), t.new_zeros((most - len(t),) + tuple(t.shape[1:])).to(device)])
        else:
            padded = torch.zeros((most,) + row, dtype=dt, device=device)
        padded = padded.contiguous()
        if dst is None:
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded)
        else:
            parts = [torch.empty_like(padded) for _ in range(world)] if receive else None
            dist.gather(padded, parts, dst=dst)
        if receive:
            for r in range(world):
                gathered[r][name] = parts[r][:lengths[r]].cpu()
    if not receive:
        return None, given[0][2]
    return [None if infos[r] is None else gathered[r] for r in range(world)], given[0][2]


def gather_ordered(outputs: Any, dst: Optional[int] = None) -> Any:
    """This rank's outputs of a sharded test loader, gathered from every rank in dataset order.

    A collective: every rank calls it once (a rank that loaded no sample passes None). In one
    process the outputs are returned as they are.

    Args:
        outputs: this rank's outputs, in the order its loader gave the samples (a tensor, an
            array, or tuples/lists/dicts of them), or None.
        dst: None: every rank gets the result; a rank: only that one does (None elsewhere).

    Returns:
        The outputs of the whole data set, in its order, in the structure given (CPU tensors,
        numpy arrays where arrays were given); None when no rank had any.
    """
    named, spec = flatten(outputs) if outputs is not None else (None, None)
    if not comm.is_dist() or comm.get_world_size() == 1:
        return None if named is None else unflatten(named, spec)
    parts, spec = _gather_named(named, dst, spec=spec)
    if parts is None:
        return None
    given = [p for p in parts if p is not None]
    if not given:
        return None
    check_shard_lengths([0 if p is None else len(next(iter(p.values()))) for p in parts])
    merged = OrderedDict((k, interleave([p[k] for p in given])) for k in given[0])
    return unflatten(merged, spec)


class OrderedCollector:
    """Gathers per-sample outputs round by round, in dataset order, into memory or a writer.

    In round k, every rank calls :meth:`add` with its k-th batch of outputs from a test loader
    of :func:`~basetrainer.dataloader.loader.build_dataloader` (``None`` once it has no batch
    left; ranks hold different numbers of batches, so loop ``max over ranks`` times). Each
    round's rows are the next consecutive samples of the data set; they go to ``writer`` (on
    ``dst``) or are kept for :meth:`finish`. Memory: one round of every rank's outputs.

    Args:
        dst: the rank that receives the rows (None: every rank, in-memory results only).
        writer: an open :class:`~basetrainer.evaluation.writers.PredictionWriter` on ``dst``
            (None elsewhere); without it the rows are kept in memory.
    """

    def __init__(self, dst: Optional[int] = None, writer: Any = None) -> None:
        if writer is not None and dst is None and comm.get_world_size() > 1:
            raise ValueError("OrderedCollector(writer=...) writes on one rank: give dst (e.g. dst=0)")
        self.dst, self.writer = dst, writer
        self.spec: Any = None
        self.sig: Optional[list] = None
        self.blocks: List[Dict[str, torch.Tensor]] = []
        self.rows = 0

    @property
    def receives(self) -> bool:
        return self.dst is None or comm.get_rank() == self.dst

    def add(self, outputs: Any) -> None:
        """One round: this rank's next batch of outputs, or None when it has none left."""
        named = None
        if outputs is not None:
            named, spec = flatten(outputs)
            if self.sig is None:
                self.spec, self.sig = spec, signature(named)
            elif signature(named) != self.sig:
                raise ValueError(f"the outputs changed structure, dtype or row shape between batches: "
                                 f"{signature(named)} after {self.sig}")
        if comm.is_dist() and comm.get_world_size() > 1:
            parts, spec = _gather_named(named, self.dst, self.sig, self.spec)
            if parts is None:
                return
            given = [p for p in parts if p is not None]
            if not given:
                return
            if self.spec is None:   # this rank had no batch yet: the structure is the others'
                self.spec, self.sig = spec, signature(given[0])
            lengths = [0 if p is None else len(next(iter(p.values()))) for p in parts]
            check_shard_lengths(lengths)
            block = OrderedDict((k, interleave([p[k] for p in parts if p is not None]))
                                for k in given[0])
        elif named is None:
            return
        else:
            block = OrderedDict((k, v.cpu()) for k, v in named.items())
        self._take(block)

    def _take(self, block: Dict[str, torch.Tensor]) -> None:
        self.rows += len(next(iter(block.values())))
        if self.writer is not None:
            self.writer.write(unflatten(block, self.spec))
        else:
            self.blocks.append(block)

    def finish(self) -> Any:
        """The outputs of every round, in dataset order (on the receiving ranks; None on the
        others); with a writer: the writer closed, its path returned."""
        if not self.receives:
            return None
        if self.writer is not None:
            return self.writer.close()
        if not self.blocks:
            return None
        merged = OrderedDict((k, torch.cat([b[k] for b in self.blocks])) for k in self.blocks[0])
        self.blocks = []
        return unflatten(merged, self.spec)

