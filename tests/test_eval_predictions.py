"""Per-sample outputs gathered over the ranks in dataset order (no padding, no duplicate, no
sample missing) and streamed to .npy / .npz / .csv files in bounded memory."""
import csv
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from basetrainer.dataloader.loader import build_dataloader
from basetrainer.evaluation import ordered, writers
from basetrainer.runtime import comm

from conftest import ROOT, run_distributed

PY = sys.executable
N = 241   # does not divide by 2 or 3 ranks, nor by the batch


def _data(n=N):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.arange(n))


class _RowWise(torch.nn.Module):
    """Each output row a function of its input row only (a matmul's rounding may depend on the
    batch it is in; this test is about the gathering, which must not change a bit)."""

    def forward(self, x):
        return torch.sin(x[:, :5] * 3.7) * torch.exp(x[:, 5:10])


def _model():
    return _RowWise()


def _outputs(model, x, idx):
    """A structure of several dtypes and shapes, as a model's outputs may be."""
    logits = model(x)
    return {"logits": logits, "pred": logits.argmax(1), "index": idx, "ok": idx % 2 == 0,
            "half": logits.half()}


# ----------------------------------------------------------------------------- interleave
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 2, 6, N])
def test_interleave_puts_the_shards_of_the_test_sampler_back_in_dataset_order(world, n):
    data = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    shards = [data[r::world] for r in range(world)]       # what ShardSampler gives rank r
    assert torch.equal(ordered.interleave(shards), data)
    assert np.array_equal(ordered.interleave([s.numpy() for s in shards]), data.numpy())


def test_interleave_refuses_shards_that_no_shard_sampler_makes():
    with pytest.raises(ValueError, match="ShardSampler"):
        ordered.interleave([torch.zeros(3), torch.zeros(5)])   # a later rank holds more
    with pytest.raises(ValueError, match="ShardSampler"):
        ordered.interleave([torch.zeros(5), torch.zeros(3)])   # more than one sample apart
    with pytest.raises(ValueError, match="shape"):
        ordered.interleave([torch.zeros(2, 3), torch.zeros(2, 4)])


def test_flatten_names_the_outputs_and_unflatten_rebuilds_them():
    out = {"a": torch.zeros(2, 3), "b": (torch.ones(2), torch.zeros(2, dtype=torch.long))}
    named, spec = ordered.flatten(out)
    assert list(named) == ["a", "b.0", "b.1"]
    back = ordered.unflatten(named, spec)
    assert torch.equal(back["a"], out["a"]) and torch.equal(back["b"][1], out["b"][1])
    assert list(ordered.flatten(torch.zeros(2))[0]) == ["output"]
    with pytest.raises(ValueError, match="samples"):
        ordered.flatten({"a": torch.zeros(2), "b": torch.zeros(3)})   # not one row per sample
    with pytest.raises(TypeError, match="str"):
        ordered.flatten({"a": "text"})


# ----------------------------------------------------------------------------- over ranks
def _predict(rank, folder, batch_size):
    """Every rank: the test loader's outputs, (1) gathered at once, (2) round by round into
    memory and into a file of each format (rank 0 writes)."""
    torch.set_num_threads(1)
    loader = build_dataloader(_data(), batch_size, phase="test", shuffle=False)
    model = _model()
    local, rounds = [], []
    with torch.no_grad():
        for x, idx in loader:
            local.append(_outputs(model, x, idx))
    mine = {k: torch.cat([o[k] for o in local]) for k in local[0]}
    at_once = ordered.gather_ordered(mine)
    to_zero = ordered.gather_ordered(mine, dst=0)
    most = max(comm.all_gather_object(len(local)))        # ranks hold different numbers of batches
    paths = {fmt: os.path.join(folder, f"pred-{comm.get_world_size()}.{fmt}") for fmt in ("npz", "csv")}
    collectors = [ordered.OrderedCollector()] + [
        ordered.OrderedCollector(dst=0, writer=writers.open_writer(p) if rank == 0 else None)
        for p in paths.values()]
    for k in range(most):
        for c in collectors:
            c.add(local[k] if k < len(local) else None)
    results = [c.finish() for c in collectors]
    return {"at_once": at_once, "to_zero": to_zero, "rounds": results[0], "files": results[1:], "paths": paths,
            "batches": len(local)}


def _reference(batch_size=16):
    loader = build_dataloader(_data(), batch_size, phase="test", shuffle=False)
    model = _model()
    with torch.no_grad():
        local = [_outputs(model, x, idx) for x, idx in loader]
    return {k: torch.cat([o[k] for o in local]) for k in local[0]}


def _bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].is_floating_point() else a[k],
                           b[k].view(torch.uint8) if b[k].is_floating_point() else b[k]), k


def _check_files(paths, ref):
    with np.load(paths["npz"]) as z:
        assert sorted(z.files) == sorted(ref)
        for k in ref:
            assert np.array_equal(z[k], ref[k].numpy()) and z[k].dtype == ref[k].numpy().dtype, k
    with open(paths["csv"], newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    assert len(body) == N and [int(r[0]) for r in body] == list(range(N))
    col = header.index("logits_0")
    got = np.array([[float(v) for v in r[col:col + 5]] for r in body], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), ref["logits"].numpy().view(np.uint32))   # bit for bit
    assert [int(r[header.index("pred")]) for r in body] == ref["pred"].tolist()


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3])
def test_outputs_over_1_2_and_3_ranks_are_the_one_process_outputs_bit_for_bit(tmp_path, world):
    ref = _reference()
    assert torch.equal(ref["index"], torch.arange(N))
    results = run_distributed(_predict, world, tmp_path, str(tmp_path), 16, timeout=240)
    if world > 1:
        assert results[0]["batches"] != results[-1]["batches"]   # uneven: 121/120 or 81/80/80 samples
    for rank, r in enumerate(results):
        _bitwise_equal(r["at_once"], ref)
        _bitwise_equal(r["rounds"], ref)
        if rank == 0:
            _bitwise_equal(r["to_zero"], ref)
            assert all(f == p for f, p in zip(r["files"], r["paths"].values()))
        else:
            assert r["to_zero"] is None and r["files"] == [None] * 2
    _check_files(results[0]["paths"], ref)


def test_in_one_process_every_helper_gives_the_outputs_unchanged(tmp_path):
    ref = _reference(batch_size=7)
    out = _predict(0, str(tmp_path), 7)
    for got in (out["at_once"], out["to_zero"], out["rounds"]):
        _bitwise_equal(got, ref)
    _check_files(out["paths"], ref)


def test_a_collector_refuses_outputs_whose_structure_changes():
    c = ordered.OrderedCollector()
    c.add({"a": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="structure"):
        c.add({"b": torch.zeros(2, 3)})


# ----------------------------------------------------------------------------- writers
@pytest.mark.parametrize("fmt", ["npy", "npz", "csv"])
def test_a_single_tensor_and_a_tuple_round_trip_through_every_format(tmp_path, fmt):
    x = torch.randn(10, 4)
    path = str(tmp_path / f"out.{fmt}")
    with writers.open_writer(path) as w:
        w.write(x[:3])
        w.write(x[3:])
    if fmt == "npz":
        with np.load(path) as z:
            assert z.files == ["output"] and np.array_equal(z["output"], x.numpy())
    elif fmt == "npy":
        assert np.array_equal(np.load(path), x.numpy())
        assert np.array_equal(np.load(path, mmap_mode="r"), x.numpy())
    else:
        with open(path) as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["index", "output_0", "output_1", "output_2", "output_3"]
        assert np.array_equal(np.array([[float(v) for v in r[1:]] for r in rows[1:]], dtype=np.float32), x.numpy())
    tup = str(tmp_path / f"tuple.{fmt}")
    if fmt == "npy":   # one array: several outputs or ids are refused, naming the formats that hold them
        with pytest.raises(ValueError, match=r"tuple\.npy.*one array.*\['output\.0', 'output\.1'\].*\.npz.*\.csv"):
            with writers.open_writer(tup) as w:
                w.write((x[:5], torch.arange(5)))
        with pytest.raises(ValueError, match=r"one array.*ids"):
            with writers.open_writer(tup) as w:
                w.write(x[:5], ids=[f"img{i}.png" for i in range(5)])
        assert _leftovers(tmp_path) == [] and not os.path.exists(tup)
        return
    with writers.open_writer(tup) as w:
        w.write((x[:5], torch.arange(5)), ids=[f"img{i}.png" for i in range(5)])
        w.write((x[5:], torch.arange(5, 10)), ids=[f"img{i}.png" for i in range(5, 10)])
    if fmt == "npz":
        with np.load(tup) as z:
            assert sorted(z.files) == ["ids", "output.0", "output.1"] and z["ids"][7] == "img7.png"
    else:
        with open(tup) as f:
            rows = list(csv.reader(f))
        assert rows[0][:3] == ["index", "id", "output.0_0"] and rows[8][1] == "img7.png"


@pytest.mark.parametrize("fmt", ["npy", "npz"])
def test_column_slices_and_one_row_chunks_of_any_strides_are_written_byte_for_byte(tmp_path, fmt):
    """A binary classifier's ``softmax(1)[:, 1]``: a batch of one row is a [1] tensor of stride 2,
    which ``.contiguous()`` leaves as it is (one element: contiguous) and which cannot be viewed
    as bytes (hostile pass: 'self.stride(-1) must be 1 to view Float as Byte')."""
    probs = torch.randn(10, 2).softmax(1)
    x = torch.randn(7, 3, 2)
    chunks = [probs[:3, 1], probs[3:9, 1], probs[9:, 1]]
    assert chunks[-1].shape == (1,) and chunks[-1].stride() == (2,)
    odd = [x[:2, :, 1], x[2:3, :1, 1], x[3:, ::2, 0][:, :1]]   # [n, k] slices, one of shape [1, 1]
    for name, parts, whole in (("col", chunks, probs[:, 1]), ("odd", odd, None)):
        path = str(tmp_path / f"{name}.{fmt}")
        with writers.open_writer(path) as w:
            for part in parts:
                w.write(part if name == "col" else {"output": part[:, :1]})
        got = np.load(path) if fmt == "npy" else np.load(path)["output"]
        want = whole if whole is not None else torch.cat([p[:, :1] for p in parts])
        assert np.array_equal(got, want.numpy()), name
    assert _leftovers(tmp_path) == []


def test_an_unknown_suffix_is_refused_naming_the_formats(tmp_path):
    with pytest.raises(ValueError, match=r"\.npy.*\.npz.*\.csv"):
        writers.open_writer(str(tmp_path / "out.json"))
    with pytest.raises(ValueError, match=r"out\.pt'.*no longer.*\.npy.*numpy\.load\(path, mmap_mode='r'\)"):
        writers.open_writer(str(tmp_path / "out.pt"))
    assert os.listdir(tmp_path) == []


def test_bfloat16_is_written_as_float32_value_for_value(tmp_path):
    x = torch.randn(6, 3).to(torch.bfloat16)
    for suffix in ("npy", "npz"):
        path = str(tmp_path / f"out.{suffix}")
        with writers.open_writer(path) as w:
            w.write(x[:4])
            w.write(x[4:])
        loaded = np.load(path)
        got = loaded if suffix == "npy" else loaded["output"]
        assert got.dtype == np.float32 and torch.equal(torch.from_numpy(np.array(got)), x.float())


def _leftovers(folder):
    return sorted(p for p in os.listdir(folder) if ".tmp" in p)


def test_a_failed_write_leaves_the_previous_file_and_no_temp(tmp_path):
    path = str(tmp_path / "out.npz")
    with writers.open_writer(path) as w:
        w.write(torch.ones(4, 2))
    with pytest.raises(RuntimeError, match="boom"):
        with writers.open_writer(path) as w:
            w.write(torch.zeros(4, 2))
            raise RuntimeError("boom")
    with np.load(path) as z:
        assert np.array_equal(z["output"], np.ones((4, 2), np.float32))   # the old file, whole
    assert _leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="structure"):
        with writers.open_writer(path) as w:
            w.write(torch.zeros(4, 2))
            w.write({"x": torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="shape"):
        with writers.open_writer(str(tmp_path / "b.npy")) as w:
            w.write(torch.zeros(4, 2))
            w.write(torch.zeros(4, 3))
    assert _leftovers(tmp_path) == [] and not os.path.exists(tmp_path / "b.npy")


def test_ids_must_be_one_per_sample(tmp_path):
    with pytest.raises(ValueError, match="ids"):
        with writers.open_writer(str(tmp_path / "a.csv")) as w:
            w.write(torch.zeros(4, 2), ids=["a", "b"])


FULL = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    from basetrainer.runtime import atomic
    from basetrainer.evaluation import writers
    import torch
    path = sys.argv[1]
    out = {{}}
    try:
        with writers.open_writer(path) as w:
            for k in range(200):
                w.write(torch.full((50, 100), float(k)))
    except BaseException as e:
        out["error"] = type(e).__name__ + ": " + str(e)
        out["errno"] = getattr(e, "errno", None)
    folder = os.path.dirname(path)
    out["files"] = sorted(os.listdir(folder))
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.distributed
@pytest.mark.parametrize("fmt", ["npy", "npz", "csv"])
def test_a_full_disk_is_one_clear_error_and_the_old_file_stays(tmp_path, fmt):
    from test_disk_full import _tmpfs_available

    reason = _tmpfs_available()
    if reason:
        pytest.skip(reason)
    script = tmp_path / "full.py"
    script.write_text(FULL.format(root=ROOT))
    mount = tmp_path / "disk"
    mount.mkdir()
    old = b"old file"
    cmd = (f"mount -t tmpfs -o size=1m tmpfs {mount} && printf '{old.decode()}' > {mount}/pred.{fmt} && "
           f"{PY} {script} {mount}/pred.{fmt} && cat {mount}/pred.{fmt}")
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(line[0][len("RESULT "):])
    assert result.get("errno") == errno.ENOSPC, result
    assert "DiskFullError" in result["error"] and str(mount) in result["error"], result["error"]
    assert result["files"] == [f"pred.{fmt}"]          # no temp or spool file left
    assert out.stdout.rstrip().endswith(old.decode())  # the previous file, whole


RSS = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    import numpy as np, torch
    from basetrainer.evaluation import writers

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024

    path, rows, width, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    block = torch.empty(chunk, width)
    w = writers.open_writer(path)
    with open("/proc/self/clear_refs", "w") as f:   # the peak (VmHWM) starts again from here
        f.write("5")
    base = status("VmRSS")
    with w:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            rows_ = torch.arange(start, start + n, dtype=torch.float64) % 8191     # row r: (r % 8191) + j / 1024
            block[:n] = (rows_[:, None] + torch.arange(width, dtype=torch.float64) / 1024).float()
            w.write(block[:n])
    peak = status("VmHWM")
    print("RESULT " + json.dumps({{"growth_mb": peak - base, "base_mb": base,
                                   "size_mb": os.path.getsize(path) / 2**20}}))
""")


def _expected_row(r, width):
    return ((r % 8191) + np.arange(width, dtype=np.float64) / 1024).astype(np.float32)


def _row_check(path, fmt, rows, width):
    """Spot-check rows without loading the file whole."""
    picks = [0, 1, 8191, rows // 2, rows - 1]
    if fmt == "npz":
        with zipfile.ZipFile(path) as z, z.open("output.npy") as f:
            assert np.lib.format.read_magic(f) == (1, 0)
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            assert shape == (rows, width) and dtype == np.float32
            start = f.tell()
            for r in picks:
                f.seek(start + r * width * 4)
                row = np.frombuffer(f.read(width * 4), np.float32)
                assert np.array_equal(row, _expected_row(r, width))
    elif fmt == "npy":
        a = np.load(path, mmap_mode="r")
        assert a.shape == (rows, width) and a.dtype == np.float32
        for r in picks:
            assert np.array_equal(a[r], _expected_row(r, width))
    else:
        with open(path) as f:
            header = f.readline().rstrip("\n").split(",")
            assert len(header) == width + 1
            for r, line in enumerate(f):
                if r in picks:
                    vals = np.array(line.rstrip("\n").split(",")[1:], dtype=np.float32)
                    assert np.array_equal(vals, _expected_row(r, width))
            assert r == rows - 1


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fmt,rows", [("npz", 100_000), ("npy", 100_000), ("csv", 20_000)])
def test_streaming_400_mb_of_outputs_keeps_peak_memory_growth_under_100_mb(tmp_path, fmt, rows):
    # 100,000 outputs of 1,000 float32 values = 400 MB (csv: 20,000 rows, 80 MB of values, about
    # 200 MB of text: it is formatted value by value)
    script = tmp_path / "rss.py"
    script.write_text(RSS.format(root=ROOT))
    path = str(tmp_path / f"big.{fmt}")
    out = subprocess.run([PY, str(script), path, str(rows), "1000", "500"], capture_output=True, text=True,
                         timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(line[0][len("RESULT "):])
    print(fmt, result)
    assert result["growth_mb"] < 100, result
    assert result["size_mb"] >= rows * 1000 * 4 / 2**20
    _row_check(path, fmt, rows, 1000)
