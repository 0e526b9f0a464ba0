"""Sharded checkpoints (``strategy: fsdp``) through ``torch.distributed.checkpoint`` (DCP).

A sharded ``last`` is two things in the checkpoint folder:

- ``last-shards-<step>-<id>/``: a DCP folder (``__<rank>_0.distcp`` per rank, ``.metadata``)
  holding only tensors: the sharded weights, optimizer state and any sharded callback state
  (e.g. ModelEMA's average). Every rank writes its own shard, in parallel.
- ``last.pth``: everything else (position, scheduler, callbacks, RNG of every rank, config,
  the unsharded buffers), in weights-only types, with ``"shards"`` naming the folder above and
  ``"dcp:<key>"`` standing where each sharded tensor was. Written atomically by rank 0 *after*
  every shard is complete, so it is the pointer that makes a new ``last`` current: a crash
  during a save leaves the previous ``last.pth`` and its folder loadable.

``last.prev.pth`` keeps the ``last`` before, with its folder; folders neither refers to are
removed after each save (the folders' names, markers and checks:
:mod:`basetrainer.runtime.shard_folders`). Loading reshards: the templates are made for the
current world size from the metadata, so a checkpoint saved by N processes resumes on any number.

The weights-only promise holds here too: the shards are read through
:mod:`basetrainer.runtime.shard_io`, which refuses metadata or items that would run code.
"""
import logging
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch

from basetrainer.runtime import atomic, comm, shard_io
from basetrainer.runtime.checkpoint import describe
from basetrainer.runtime.safe_load import load_file, non_finite
# the folders' names and checks live below checkpoint.py (its folder keeps them); PREFIX and
# check stay reachable here too, where tests/test_checkpoint_crc.py and test_disk_full.py use them
from basetrainer.runtime.shard_folders import MARKER, PREFIX, check, markers, new_name  # noqa: F401
from basetrainer.runtime.shard_io import failure, read_metadata, write_shards

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- split and join
def _is_sharded(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def split(state: Any, prefix: str = "") -> Tuple[Any, Dict[str, Any]]:
    """``(rest, tensors)``: every DTensor of ``state`` moved to ``tensors`` (flat, keyed by its
    path) and replaced in ``rest`` by ``"dcp:<path>"``."""
    tensors: Dict[str, Any] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, f"{path}/{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            out = [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
            return out if isinstance(value, list) else tuple(out)
        if _is_sharded(value):
            tensors[path] = value
            return MARKER + path
        return value

    return walk(state, prefix), tensors


def join(rest: Any, tensors: Dict[str, Any]) -> Any:
    if isinstance(rest, dict):
        return {k: join(v, tensors) for k, v in rest.items()}
    if isinstance(rest, (list, tuple)):
        out = [join(v, tensors) for v in rest]
        return out if isinstance(rest, list) else tuple(out)
    if isinstance(rest, str) and rest.startswith(MARKER):
        return tensors[rest[len(MARKER):]]
    return rest


# ----------------------------------------------------------------------------- saving
def non_finite_local(tensors: Dict[str, Any]) -> List[str]:
    """Names of the sharded tensors whose local shard holds NaN or inf, on any rank."""
    local = {k: v.to_local() for k, v in tensors.items()}
    bad = non_finite(local)
    everywhere = comm.all_gather_object(bad)
    return sorted({k for part in everywhere for k in part})


def _points_at(path: str, name: str) -> bool:
    """Whether the checkpoint file ``path`` refers to the shard folder ``name``."""
    try:
        state = load_file(path)
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("shards") == name


# ----------------------------------------------------------------------------- loading
def load(state: dict, folder: str, mesh: Any = None) -> dict:
    """``state`` with every ``"dcp:<key>"`` replaced by the tensor read from its shards: a
    DTensor sharded over ``mesh`` (dim 0, as ``fully_shard`` shards), or a whole tensor when
    ``mesh`` is None (a model that is not sharded). Collective when a process group exists."""
    import torch.distributed.checkpoint as dcp

    shards = os.path.join(folder, str(state["shards"]))
    metadata = read_metadata(shards)
    keys = markers(state)
    templates: Dict[str, Any] = {}
    for key in keys:
        item = metadata.state_dict_metadata.get(key)
        if item is None:
            raise ValueError(f"sharded checkpoint {shards!r} lacks {key!r}")
        dtype = item.properties.dtype
        if mesh is not None and len(item.size) > 0:
            import torch.distributed.tensor as dtensor
            from torch.distributed.tensor import Shard

            templates[key] = dtensor.zeros(item.size, dtype=dtype, device_mesh=mesh, placements=[Shard(0)])
        else:
            templates[key] = torch.zeros(item.size, dtype=dtype)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(templates, storage_reader=shard_io.reader_class()(shards), no_dist=not comm.is_dist())
    except CheckpointException as e:
        raise failure(e, f"reading the shards of {shards}") from e
    return join(state, templates)


def save(engine: Any, folder: Any, state: dict, path: Optional[str] = None) -> None:
    """Save ``state`` (``engine``'s checkpoint, its sharded tensors in it) as a sharded ``last``
    in ``folder`` (a CheckpointFolder); every rank calls it. The staged files (best and per-epoch weights) get the whole weights, gathered
    to the main process on the CPU (no rank gathers the optimizer state).

    Raises:
        FloatingPointError: a weight is NaN or inf on some rank (nothing is written).
        DiskFullError: no space for the shards or for a file of the main process; raised on
            every rank, the same one, and the new shards are removed (the previous save stays).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rest, tensors = split(state)
    bad = non_finite_local(tensors)
    if bad:
        folder.discard_staged()
        raise FloatingPointError(f"refusing to save {describe(state)}: non-finite weights in {', '.join(bad[:5])}; "
                                 f"the previous checkpoint in {folder.folder} is kept")
    need_full = comm.broadcast_object(folder.has_staged if comm.is_main_process() else None)
    weights = None
    if need_full:
        weights = get_model_state_dict(engine.unwrapped_model,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    name = new_name(engine.global_step, path)
    os.makedirs(folder.folder, exist_ok=True)
    shards = os.path.join(folder.folder, name)
    write_shards(tensors, shards, intact=folder.intact)
    error = None
    if comm.is_main_process():
        rest["shards"] = name
        try:
            folder.commit(rest, background=False, path=path, weights=weights)
        except Exception as e:
            if not _points_at(path or folder.last, name):   # the pointer was not written: the shards are no one's
                shutil.rmtree(shards, ignore_errors=True)
            error = e
    # every rank ends the save the same way (the others would wait for the main process at their
    # next collective, and fail there with a broken connection)
    told = comm.broadcast_object(None if error is None else (
        error.errno if isinstance(error, atomic.DiskFullError) else None,
        error.strerror if isinstance(error, atomic.DiskFullError) else str(error), type(error).__name__))
    if error is not None:
        raise error
    if told is not None:
        number, text, kind = told
        if number is not None:
            raise atomic.DiskFullError(number, text)
        if kind == "FloatingPointError":
            raise FloatingPointError(text)
        raise RuntimeError(f"the main process failed to write the checkpoint ({kind}: {text})")


# ----------------------------------------------------------------------------- one file
def consolidate(last: str, out: str) -> str:
    """Write the whole model weights of the sharded checkpoint ``last`` (its ``last.pth``) as
    one ordinary ``.pth`` state dict (what ``finetune``, pruning and inference load), in one
    process, without a process group. The shards' tensors are read whole, so this process
    needs the model's weights in memory once (not the optimizer state).

    Command line: ``python -m basetrainer.runtime.sharded <work_dir>/model/last.pth model.pth``.

    Ours, not torch's ``dcp_to_torch_save`` (issue 27.3). Measured on a 2-rank fsdp checkpoint
    of tests/fsdp_common.BlockNet with ModelEMA: both give the trained weights to the bit, but
    dcp_to_torch_save unpickles ``.metadata`` with ``pickle`` (a planted payload ran before it
    failed; here it is refused unrun), reads and writes every tensor of the save (30 tensors,
    36.0 kB: optimizer state and the EMA too, against 10 tensors, 12.7 kB), keys them
    ``model/<name>`` (not a state dict finetune or pruning load), and ``torch.save``s straight to
    the final path (a crash leaves a partial file there; ours is atomic).
    """
    if os.path.isdir(last):   # a checkpoint folder: its last.pth
        last = os.path.join(last, "last.pth")
    state = load_file(last)
    if not isinstance(state, dict) or not state.get("shards"):
        raise ValueError(f"{last!r} is not a sharded checkpoint (no 'shards' entry); a one-file checkpoint "
                         f"already holds its weights under 'model'")
    model_only = {"shards": state["shards"], "model": state["model"]}
    weights = load(model_only, os.path.dirname(os.path.abspath(last)), mesh=None)["model"]
    return atomic.write_atomically(weights, out)


if __name__ == "__main__":   # pragma: no cover - exercised through a subprocess in the tests
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(sys.argv) != 3:
        sys.exit("usage: python -m basetrainer.runtime.sharded <sharded last.pth, or its folder> <out.pth>")
    try:
        logger.info("wrote %s", consolidate(sys.argv[1], sys.argv[2]))
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
