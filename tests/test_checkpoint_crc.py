"""A flipped bit in a weight is found (torch stores a CRC-32 per record and never checks it; the
changed weight loads as another finite value): in a one-file checkpoint, where resume falls back
to last.prev.pth, and in a shard of a sharded checkpoint."""
import io
import os
import struct
import zipfile

import pytest
import torch

from basetrainer.runtime import checkpoint, shard_io, sharded


def _flip_weight_bit(path, start=0, length=None):
    """Flip the lowest mantissa bit of the first float of the torch file at ``start`` in ``path``
    (its ``data/0`` record): the value changes and stays finite."""
    with open(path, "rb") as f:
        f.seek(start)
        blob = f.read(length) if length else f.read()
    archive = zipfile.ZipFile(io.BytesIO(blob))
    info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    at = start + info.header_offset + 30 + name_len + extra_len
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))


def _state(epoch):
    return {"format": checkpoint.FORMAT, "epoch": epoch, "phase": "end", "batch": 0, "global_step": epoch + 1,
            "model": {"w": torch.linspace(-1, 1, 64) + epoch}}


def test_a_flipped_bit_in_a_one_file_checkpoint_falls_back_to_last_prev(tmp_path):
    folder = checkpoint.CheckpointFolder(str(tmp_path))
    folder.commit(_state(0), background=False)
    folder.commit(_state(1), background=False)
    _flip_weight_bit(folder.last)
    changed = torch.load(folder.last, weights_only=True)["model"]["w"]          # what torch alone gives
    assert torch.isfinite(changed).all() and not torch.equal(changed, _state(1)["model"]["w"])
    with pytest.raises(ValueError, match=r"last.pth' is damaged: data/0 does not match the CRC-32"):
        checkpoint.load_file(folder.last)
    path, state = checkpoint.CheckpointFolder(str(tmp_path)).find_resumable()
    assert path == folder.previous and state["epoch"] == 0
    assert checkpoint.crc_errors(folder.previous) == []


def test_a_flipped_bit_in_a_shard_is_found(tmp_path):
    import torch.distributed.checkpoint as dcp

    shards = tmp_path / "last-shards-00000001-0123abcd"
    dcp.save({"model/w": torch.linspace(-1, 1, 64)}, storage_writer=dcp.FileSystemWriter(str(shards)),
             no_dist=True)
    state = {"shards": shards.name, "model": {"w": "dcp:model/w"}}
    sharded.check(state, str(tmp_path))                                          # as written: good
    item = next(iter(shard_io.read_metadata(str(shards)).storage_data.values()))
    _flip_weight_bit(str(shards / item.relative_path), item.offset, item.length)
    with pytest.raises(ValueError, match=r"is damaged \(model/w: its bytes do not match the CRC-32"):
        sharded.check(state, str(tmp_path))


def test_files_written_without_checksums_still_load(tmp_path):
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(_state(0), tmp_path / "no_crc.pth")
    finally:
        torch.serialization.set_crc32_options(True)
    assert checkpoint.load_file(str(tmp_path / "no_crc.pth"))["epoch"] == 0
    torch.save(_state(0), tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert checkpoint.crc_errors(str(tmp_path / "legacy.pth")) == []
    assert checkpoint.load_file(str(tmp_path / "legacy.pth"))["epoch"] == 0
