"""The files of ``torch.distributed.checkpoint`` (DCP), read without running code and written
with a full disk reported on every rank: what :mod:`basetrainer.runtime.sharded` stores its
shards with.

Reading: torch 2.14's DCP reads ``.metadata`` with ``pickle.load`` and non-tensor items with
``weights_only=False``. :func:`read_metadata` reads the metadata with an unpickler that only
builds DCP's own metadata classes (anything else is refused before it runs) and refuses
non-tensor items; the reader of :func:`reader_class` uses it, and tensors are read with
``weights_only``.

Writing: :func:`write_shards` has every rank write its shards, fsynced; a lack of space on any
rank becomes one :class:`~basetrainer.runtime.atomic.DiskFullError` on every rank, and the
partial folder is removed.
"""
import errno
import io
import os
import pickle
import shutil
from typing import Any, Callable, Dict, List, Optional

import torch

from basetrainer.runtime import atomic, comm

# what DCP 2.14's .metadata holds (module -> names); nothing else is ever built
_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint that would run code, or hold objects other than tensors, when loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"it names {module}.{name}, which DCP metadata never holds (it would be "
                                    f"called while loading)")


def read_metadata(folder: str) -> Any:
    """The DCP metadata of ``folder``, read without running code.

    Raises:
        UnsafeCheckpointError: the metadata names anything but DCP's metadata classes, or the
            checkpoint holds non-tensor items (DCP would unpickle those with code).
        ValueError: no metadata, or it is damaged.
    """
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = os.path.join(folder, ".metadata")
    if not os.path.isdir(folder):
        raise ValueError(f"the shard folder {folder!r} is missing: a sharded last.pth holds only a pointer to it; "
                         f"copy or move the folder together with last.pth")
    if not os.path.isfile(path):
        raise ValueError(f"sharded checkpoint {folder!r} has no .metadata (its save did not finish)")
    with open(path, "rb") as f:
        data = f.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"refused to load {path!r}: {e}. Only checkpoints this library wrote "
                                    f"(tensors and DCP metadata) are loaded") from None
    except Exception as e:
        raise ValueError(f"sharded checkpoint {folder!r}: its .metadata is damaged "
                         f"({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"refused to load {path!r}: it holds a {type(metadata).__name__}, "
                                    f"not DCP metadata")
    other = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
    if other:
        raise UnsafeCheckpointError(f"refused to load {folder!r}: items {other[:5]} are not tensors (DCP would "
                                    f"unpickle them with code); sharded checkpoints hold tensors only")
    for item in (metadata.storage_data or {}).values():
        file = os.path.join(folder, str(item.relative_path))
        if os.path.dirname(os.path.abspath(file)) != os.path.abspath(folder):
            raise UnsafeCheckpointError(f"refused to load {folder!r}: its metadata points outside the folder")
        if not os.path.isfile(file) or os.path.getsize(file) < item.offset + item.length:
            raise ValueError(f"sharded checkpoint {folder!r}: {item.relative_path} is missing or truncated")
    return metadata


def reader_class() -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """DCP's file reader with the metadata read by :func:`read_metadata`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_metadata(str(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _writer_class() -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    class SpaceAwareWriter(FileSystemWriter):
        """DCP's file writer, whose lack of space reaches every rank as an OSError.

        DCP sends each rank's error to the others pickled, which drops what it was raised from:
        torch's zip writer reports a full disk as ``RuntimeError: unexpected pos`` with the
        OSError only as its context, so the other ranks saw no ENOSPC at all. Here the ENOSPC
        behind an error is raised in its place, on the rank where it happened."""

        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().write_data(*args, **kwargs)
            except Exception as e:
                _raise_space_error(e, comm.get_rank())
                raise

        def finish(self, *args: Any, **kwargs: Any) -> None:
            try:
                super().finish(*args, **kwargs)
            except Exception as e:
                _raise_space_error(e, comm.get_rank())
                raise

    return SpaceAwareWriter


def _raise_space_error(e: BaseException, rank: int) -> None:
    space = atomic.space_error(e)
    if space is not None:
        raise OSError(space.errno, f"{space.strerror or 'No space left on device'} (rank {rank})",
                      space.filename) from None


def failure(e: BaseException, what: str) -> Exception:
    """An error to raise for DCP's ``CheckpointException`` ``e`` (a BaseException holding a
    traceback per rank, which ``except Exception`` does not catch): a RuntimeError naming what
    failed, the ranks and the first rank's error, with ``e`` kept as its cause."""
    failures = getattr(e, "failures", None) or {}
    if not failures:
        return e if isinstance(e, Exception) else RuntimeError(f"{what} failed: {type(e).__name__}: {e}")
    rank, wrapped = sorted(failures.items())[0]
    error = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    text = str(error).splitlines()[0] if str(error) else ""
    return RuntimeError(f"{what} failed on rank(s) {sorted(failures)}; rank {rank}: {type(error).__name__}: {text}")


def _disk_full(e: BaseException, folder: str, needed: int) -> bool:
    """Whether ``e`` (DCP's error, or one rank's) comes from a full disk: an ENOSPC/EDQUOT in
    it, or torch's "unexpected pos" (a short write) where less than ``needed`` bytes are free."""
    if atomic.space_error(e) is not None:
        return True
    failures = getattr(e, "failures", None) or {0: (e, None)}
    short = any("unexpected pos" in str(f[0] if isinstance(f, tuple) else f) for f in failures.values())
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(folder))).free
    except OSError:
        return False
    return short and free < needed


def write_shards(tensors: Dict[str, Any], folder: str, intact: Optional[Callable[[], str]] = None) -> None:
    """Every rank writes its shards of ``tensors`` into ``folder`` (collective); the files are
    fsynced, and the folder too, before this returns on any rank.

    Raises:
        DiskFullError: on every rank, the same one, when any rank ran out of space; the partial
            ``folder`` is removed, and the message ends with ``intact()`` (called on the main
            process: what of the previous save is whole).
        RuntimeError: DCP failed otherwise (its per-rank errors are the cause).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    needed = sum(t.numel() * t.element_size() for t in tensors.values())   # this rank's share of the save
    try:   # the name is new (step + a random id): no earlier save wrote there
        dcp.save(tensors, storage_writer=_writer_class()(folder, sync_files=True))
    except CheckpointException as e:
        # raised on every rank, after every rank's writes ended (DCP gathers their results first):
        # the main process decides, removes the partial folder and tells the others
        verdict = None
        if comm.is_main_process() and _disk_full(e, folder, needed):
            shutil.rmtree(folder, ignore_errors=True)
            verdict = no_space_message(folder, needed * comm.get_world_size(), intact() if intact else "")
        verdict = comm.broadcast_object(verdict)
        if verdict is not None:
            raise atomic.DiskFullError(errno.ENOSPC, verdict) from None
        raise failure(e, f"writing the shards of {folder}") from e
    except Exception as e:   # raised before DCP's collectives, on this rank
        if not _disk_full(e, folder, needed):
            raise
        raise atomic.DiskFullError(errno.ENOSPC, no_space_message(folder, needed, "")) from None
    if comm.is_main_process():
        atomic.fsync_folder(folder)
        atomic.fsync_folder(os.path.dirname(folder))
    comm.synchronize()


def no_space_message(shards: str, needed: int, intact: str) -> str:
    """Why a sharded save failed for lack of space: the folder, about how much a save takes
    (the previous save's shards on disk, else at least the tensors' bytes) and how much is free."""
    parent = os.path.dirname(os.path.abspath(shards))
    try:
        free: Optional[int] = shutil.disk_usage(parent).free
    except OSError:
        free = None
    stem = os.path.basename(shards).rsplit("-", 2)[0] + "-"   # last-shards-<step>-<id>: last-shards-
    before = [_size(os.path.join(parent, n)) for n in _listdir(parent)
              if n.startswith(stem) and n != os.path.basename(shards)]
    size = (f"about {atomic.human(max(before))} (as the previous save's)" if before and max(before)
            else f"at least {atomic.human(needed)}")
    return (f"no space left in {parent}: the shards of this save ({os.path.basename(shards)}, removed) need "
            f"{size} and {atomic.human(free)} is free. {intact}").rstrip()


def _listdir(folder: str) -> List[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in _listdir(folder)
               if os.path.isfile(os.path.join(folder, n)))
