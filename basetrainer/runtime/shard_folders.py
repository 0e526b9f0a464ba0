"""The shard folders of a checkpoint folder (``strategy: fsdp``; see
:mod:`basetrainer.runtime.sharded`): their names, the ``"dcp:<key>"`` markers a ``last.pth``
holds in place of each sharded tensor, checking a folder's shards before a resume, and finding
which folders a ``last`` refers to, so that the others can be removed.

Below :mod:`basetrainer.runtime.checkpoint` (whose folder keeps the shard folders of its
``last.pth`` and ``last.prev.pth``) and :mod:`basetrainer.runtime.sharded` (which writes them).
"""
import io
import os
import shutil
import uuid
from typing import Any, List, Optional, Tuple

import torch

from basetrainer.runtime import comm
from basetrainer.runtime.safe_load import crc_errors, load_file, non_finite
from basetrainer.runtime.shard_io import UnsafeCheckpointError, read_metadata

MARKER = "dcp:"
PREFIX = "last-shards-"


def markers(rest: Any) -> List[str]:
    found: List[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, str) and value.startswith(MARKER):
            found.append(value[len(MARKER):])

    walk(rest)
    return found


def new_name(step: int, path: Optional[str] = None) -> str:
    """A fresh shard folder name (rank 0 picks it; every rank receives it): ``last-shards-...``
    for ``last.pth``, which saves clean up after; ``<name>-shards-...`` for a save to another
    ``path`` (a snapshot: kept)."""
    stem = PREFIX if path is None or os.path.basename(path) == "last.pth" else os.path.basename(path) + "-shards-"
    return comm.broadcast_object(f"{stem}{int(step):08d}-{uuid.uuid4().hex[:8]}" if comm.is_main_process() else None)


def referenced(folder: str, names: Tuple[str, ...]) -> List[str]:
    """Shard folders the files ``names`` of ``folder`` refer to."""
    found = []
    for name in names:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            try:
                state = load_file(path)
            except ValueError:
                continue
            if isinstance(state, dict) and state.get("shards"):
                found.append(str(state["shards"]))
    return found


def has_shard_folders(folder: str) -> bool:
    return os.path.isdir(folder) and any(n.startswith(PREFIX) for n in os.listdir(folder))


def remove_unreferenced(folder: str, keep: List[str]) -> None:
    """Delete the shard folders of ``folder`` that no ``last`` refers to (main process)."""
    for name in os.listdir(folder):
        if name.startswith(PREFIX) and name not in keep and os.path.isdir(os.path.join(folder, name)):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def check(state: dict, folder: str) -> None:
    """Raise ValueError when the shards ``state`` refers to are missing, damaged or unsafe:
    the metadata is read safely and every stored tensor is checked against the CRC-32 torch
    stored with it, loaded (``weights_only``, one at a time) and checked to be finite."""
    shards = os.path.join(folder, str(state["shards"]))
    metadata = read_metadata(shards)
    absent = [k for k in markers(state) if k not in metadata.state_dict_metadata]
    if absent:
        raise ValueError(f"sharded checkpoint {shards!r} lacks {absent[:3]}")
    for index, item in (metadata.storage_data or {}).items():
        with open(os.path.join(shards, str(item.relative_path)), "rb") as f:
            f.seek(item.offset)
            data = f.read(item.length)
        bad = crc_errors(io.BytesIO(data))
        if bad:   # a changed byte of a weight would load as another finite value
            raise ValueError(f"sharded checkpoint {shards!r}: {item.relative_path} is damaged ({index.fqn}: its "
                             f"bytes do not match the CRC-32 stored when they were written)")
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"sharded checkpoint {shards!r}: {item.relative_path} is damaged ({index.fqn}: "
                             f"{type(e).__name__})") from None
        if not isinstance(tensor, torch.Tensor):
            raise UnsafeCheckpointError(f"refused to load {shards!r}: {index.fqn} is not a tensor")
        if non_finite({index.fqn: tensor}):
            raise ValueError(f"sharded checkpoint {shards!r} holds non-finite values in {index.fqn}")
