"""evaluate() and predict() on the trainer: the test figures of the trainer's recorders, outputs
in dataset order over 1, 2 and 3 ranks (launch(), gloo; ddp and fsdp), streamed to files in
bounded memory, weights from a checkpoint, the examples' --eval_only / --predict, bad input."""
import csv
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.metric.accuracy_recorder import AccuracyRecorder

from conftest import ROOT, ToyTrainer, blobs, make_image_folder, run_distributed, toy_cfg

PY = sys.executable
TESTS = os.path.join(ROOT, "tests")
EXAMPLE = os.path.join(ROOT, "examples", "example.py")
N_TEST = 241


class RowWise(nn.Module):
    """``x[:, :4] * w + b``: each row depends on its own sample only (no reduction over features
    or samples), so a sample's outputs are the same bits whatever batch or rank computes them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 2.0, 4))
        self.b = nn.Parameter(torch.tensor([0.1, -0.2, 0.3, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :4] * self.w + self.b


class RowTrainer(ToyTrainer):
    def build_model(self, cfg, **kwargs):
        return self.build_model_parallel(RowWise(), cfg.gpu_id, distributed=cfg.distributed)


def flat16(image):
    """A test transform for the image folders: the first 16 values of the image tensor."""
    from torchvision.transforms.functional import to_tensor

    return to_tensor(image).flatten()[:16]


def _recorders():
    return [AccuracyRecorder(), LossesRecorder()]


def _cfg(**over):
    return toy_cfg(**{"n_test": N_TEST, "num_epochs": 1, "batch_size": 16, **over})


def _weights(tmp_path):
    """A trained RowWise's weights file (one process, one epoch)."""
    t = RowTrainer(_cfg(), callbacks=_recorders())
    t.run()
    path = str(tmp_path / "weights.pth")
    torch.save(t.unwrapped_model.state_dict(), path)
    return path


def _images(tmp_path):
    root = make_image_folder(str(tmp_path / "images"), ["a", "b"], per_class=5, size=8)
    make_image_folder(os.path.join(root, "b", "deeper"), ["c"], per_class=2, size=8)
    return root


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


# ----------------------------------------------------------------------------- one process
def test_evaluate_gives_the_last_epochs_test_figures_and_leaves_the_run_alone(tmp_path):
    t = ToyTrainer(toy_cfg(n_test=N_TEST, num_epochs=2), callbacks=_recorders())
    history = t.run()
    last = {k: v for k, v in history.last.items() if k.startswith("test/")}
    assert set(last) == {"test/Accuracy", "test/loss"}
    weights = {k: v.clone() for k, v in t.unwrapped_model.state_dict().items()}
    t.model.train()
    figures = t.evaluate()
    assert figures == last   # the same forward over the same shards: the same floats
    assert all(torch.equal(weights[k], v) for k, v in t.unwrapped_model.state_dict().items())
    assert t.global_step == 2 * 8 and t.epoch == 1 and t.model.training
    # another data set, given as a data set: figures of it
    other = t.evaluate(blobs(100, 4, seed=7))
    x, y = blobs(100, 4, seed=7).tensors
    with torch.no_grad():
        logits = t.model(x)
    assert other["test/Accuracy"] == float((logits.argmax(1) == y).float().mean())
    assert other["test/loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, y)), rel=1e-6)


def test_evaluate_loads_a_weights_file_last_pth_or_the_newest_checkpoint(tmp_path):
    work = str(tmp_path / "run")
    ckpt = ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss")
    trained = ToyTrainer(toy_cfg(n_test=N_TEST, num_epochs=2, work_dir=work), callbacks=_recorders() + [ckpt])
    last = {k: v for k, v in trained.run().last.items() if k.startswith("test/")}
    best = [f for f in os.listdir(os.path.join(work, "model")) if f.startswith("best_model_")]
    assert len(best) == 1
    for checkpoint in (os.path.join(work, "model", best[0]), os.path.join(work, "model", "last.pth"), "auto"):
        fresh = ToyTrainer(toy_cfg(n_test=N_TEST, num_epochs=2, work_dir=work, resume="auto"), callbacks=_recorders())
        untrained = fresh.evaluate()
        assert untrained != last
        assert fresh.evaluate(checkpoint=checkpoint) == last, checkpoint
        assert fresh.global_step == 0 and fresh.start_epoch == 0   # the weights only


def test_evaluate_writes_the_eval_report_of_an_eval_report_callback(tmp_path):
    pytest.importorskip("sklearn.metrics")
    from basetrainer.callbacks.eval_report import EvalReport

    report = EvalReport(out_dir=str(tmp_path / "eval"), topk=(1, 2))
    t = ToyTrainer(toy_cfg(n_test=N_TEST, num_epochs=5), callbacks=_recorders() + [report])   # epoch 0 of 5
    figures = t.evaluate()
    on_disk = json.load(open(tmp_path / "eval" / "evaluate" / "report.json"))   # beside the run's report
    assert on_disk["num_samples"] == N_TEST and on_disk["accuracy"] == pytest.approx(figures["test/Accuracy"], abs=1e-12)
    assert report.last_report["accuracy"] == on_disk["accuracy"] and not t.evaluating


def test_predict_gives_every_samples_outputs_in_order_in_memory_and_in_files(tmp_path):
    t = RowTrainer(_cfg(), callbacks=_recorders())
    t.run()
    x = blobs(N_TEST, 4, seed=1).tensors[0]
    with torch.no_grad():
        expected = t.model(x)
    assert torch.equal(t.predict(t.test_loader), expected)
    assert torch.equal(t.predict(blobs(N_TEST, 4, seed=1), batch_size=7), expected)   # a data set
    npz = t.predict(t.test_loader, output=str(tmp_path / "p.npz"))
    assert npz == str(tmp_path / "p.npz") and np.array_equal(np.load(npz)["output"], expected.numpy())
    npy = np.load(t.predict(t.test_loader, output=str(tmp_path / "p.npy")), mmap_mode="r")
    assert isinstance(npy, np.memmap) and np.array_equal(npy, expected.numpy())
    rows = _csv(t.predict(t.test_loader, output=str(tmp_path / "p.csv")))
    assert rows[0] == ["index", "output_0", "output_1", "output_2", "output_3"] and len(rows) == 1 + N_TEST
    assert np.array_equal(np.array([[float(v) for v in r[1:]] for r in rows[1:]], dtype=np.float32), expected.numpy())
    assert [int(r[0]) for r in rows[1:]] == list(range(N_TEST))


def test_predict_on_a_folder_names_each_row_by_its_file(tmp_path):
    t = RowTrainer(_cfg(), callbacks=_recorders())
    root = _images(tmp_path)
    rows = _csv(t.predict(root, output=str(tmp_path / "images.csv"), transform=flat16))
    from PIL import Image

    files = ["a/0.png", "a/1.png", "a/2.png", "a/3.png", "a/4.png", "b/0.png", "b/1.png", "b/2.png", "b/3.png",
             "b/4.png", "b/deeper/c/0.png", "b/deeper/c/1.png"]
    assert [r[1] for r in rows[1:]] == files
    with torch.no_grad():
        expected = t.model(torch.stack([flat16(Image.open(os.path.join(root, f)).convert("RGB")) for f in files]))
    assert np.array_equal(np.array([[float(v) for v in r[2:]] for r in rows[1:]], dtype=np.float32), expected.numpy())
    assert torch.equal(t.predict(root, transform=flat16), expected)


def test_predict_uses_the_test_data_sets_transform_and_an_overridden_predict_step(tmp_path):
    from torchvision.datasets import ImageFolder

    class Images(RowTrainer):
        def build_test_loader(self, cfg, **kwargs):
            dataset = ImageFolder(str(tmp_path / "images"), transform=flat16)
            return self.build_dataloader(dataset, cfg.batch_size, 0, phase="test", shuffle=False)

        def predict_step(self, batch):
            logits = super().predict_step(batch)
            return {"class": logits.argmax(1), "probs": logits.softmax(1)}

    root = _images(tmp_path)
    t = Images(_cfg(), callbacks=_recorders())
    out = t.predict(root)
    logits = t.predict(t.test_loader.dataset)   # (image, label) items: the inputs are the first entry
    assert set(out) == {"class", "probs"} and out["class"].dtype == torch.int64 and len(out["class"]) == 12
    assert torch.equal(out["class"], out["probs"].argmax(1)) and torch.equal(out["probs"].argmax(1), logits["class"])


# ----------------------------------------------------------------------------- 1, 2 and 3 ranks
SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    import torch
    from basetrainer.engine.launch import launch
    from basetrainer.runtime import comm
    from test_inference import RowTrainer, _cfg, _recorders, flat16

    def main(work, weights, images, strategies):
        results = {{}}
        for strategy in strategies:
            t = RowTrainer(_cfg(distributed=True, gpu_id=list(range(comm.get_world_size())), strategy=strategy),
                           callbacks=_recorders())
            figures = t.evaluate(checkpoint=weights)
            outputs = t.predict(t.test_loader)
            files = {{ext: t.predict(t.test_loader, output=os.path.join(work, strategy + "." + ext))
                     for ext in ("npy", "npz", "csv")}}
            files["images"] = t.predict(images, output=os.path.join(work, strategy + "_images.csv"), transform=flat16)
            one = t.predict(os.path.join(images, "a", "0.png"), transform=flat16)   # fewer samples than ranks
            results[strategy] = {{"figures": figures, "outputs": outputs, "files": files, "one": one,
                                  "test_batches": len(t.test_loader), "world": comm.get_world_size()}}
        torch.save(results, os.path.join(work, "rank%d.pt" % comm.get_rank()))

    if __name__ == "__main__":
        work, weights, images, procs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
        launch(main, num_gpus_per_machine=procs, dist_url="auto", distributed=True,
               args=(work, weights, images, sys.argv[5:]), timeout=60)
""")


def _reference(tmp_path, weights, images):
    t = RowTrainer(_cfg(), callbacks=_recorders())
    out = {"figures": t.evaluate(checkpoint=weights), "outputs": t.predict(t.test_loader)}
    for ext in ("npy", "npz", "csv"):
        out[ext] = t.predict(t.test_loader, output=str(tmp_path / f"one.{ext}"))
    out["images"] = t.predict(images, output=str(tmp_path / "one_images.csv"), transform=flat16)
    out["one"] = t.predict(os.path.join(images, "a", "0.png"), transform=flat16)
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("procs", [2, 3])
def test_evaluate_and_predict_over_2_and_3_ranks_equal_one_process(tmp_path, procs):
    weights, images = _weights(tmp_path), _images(tmp_path)
    one = _reference(tmp_path, weights, images)
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT.format(tests=TESTS))
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([PY, str(script), str(work), weights, images, str(procs), "ddp", "fsdp"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(procs):
        result = torch.load(work / f"rank{rank}.pt", weights_only=False)
        for strategy in ("ddp", "fsdp"):
            r = result[strategy]
            assert r["world"] == procs
            # 241 samples: shards of 121/120 (2 ranks, 8 a batch) or 81/80/80 (3 ranks, 5 a batch)
            assert r["test_batches"] == {2: [16, 15], 3: [17, 16, 16]}[procs][rank]
            assert r["figures"]["test/Accuracy"] == one["figures"]["test/Accuracy"]   # counts: exact
            assert r["figures"]["test/loss"] == pytest.approx(one["figures"]["test/loss"], rel=1e-6, abs=0)
            assert torch.equal(r["outputs"], one["outputs"]), (strategy, rank)        # every rank, bit for bit
            assert r["one"].shape == (1, 4) and torch.equal(r["one"], one["one"])
    for strategy in ("ddp", "fsdp"):
        assert np.array_equal(np.load(work / f"{strategy}.npz")["output"], np.load(one["npz"])["output"])
        assert np.array_equal(np.load(work / f"{strategy}.npy"), np.load(one["npy"]))
        assert (work / f"{strategy}.csv").read_text() == open(one["csv"]).read()
        assert (work / f"{strategy}_images.csv").read_text() == open(one["images"]).read()
    assert len(_csv(one["csv"])) == 1 + N_TEST and len(_csv(one["images"])) == 1 + 12


def _predict_with_a_broken_image(rank, root, output, strategy="ddp"):
    t = RowTrainer(_cfg(distributed=True, gpu_id=[0, 1], strategy=strategy), callbacks=_recorders())
    try:
        t.predict(root, output=output, transform=flat16)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_that_fails_inside_predict_makes_every_rank_raise_instead_of_waiting(tmp_path, strategy):
    """Under fsdp the failure is agreed before the forward, which all-gathers (it waited out the
    group's timeout: hostile pass)."""
    root = _images(tmp_path)
    (tmp_path / "images" / "a" / "1.png").write_bytes(b"not a png")   # sample 1: rank 1's first batch
    messages = run_distributed(_predict_with_a_broken_image, 2, tmp_path, root, str(tmp_path / "p.csv"), strategy,
                               timeout=120)
    assert "1.png" in messages[1] and "no error" not in messages[1]
    assert messages[0].startswith("RuntimeError: predict() failed on rank 1: ") and "1.png" in messages[0]
    assert not os.path.exists(tmp_path / "p.csv") and not [f for f in os.listdir(tmp_path) if ".part" in f]


def _predict_into(rank, root, outputs):
    import time

    t = RowTrainer(_cfg(distributed=True, gpu_id=[0, 1]), callbacks=_recorders())
    begin = time.monotonic()
    try:
        t.predict(root, output=outputs[rank], transform=flat16)
    except Exception as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - begin
    return "no error", time.monotonic() - begin


@pytest.mark.distributed
def test_an_output_file_the_main_process_cannot_open_makes_every_rank_raise_at_once(tmp_path):
    """The file is opened on rank 0 only, before the first round: its failure must reach rank 1
    as an error naming rank 0, not leave it waiting in the first round's collective until the
    group's timeout (60 s here)."""
    root = _images(tmp_path)
    (tmp_path / "a_file").write_text("not a folder")
    bad = str(tmp_path / "a_file" / "p.csv")   # its folder is a file: rank 0 cannot create it
    messages = run_distributed(_predict_into, 2, tmp_path, root, [bad, bad], timeout=150)
    (m0, s0), (m1, s1) = messages
    assert "a_file" in m0 and "no error" not in m0
    assert m1.startswith("RuntimeError: predict() failed on rank 0: ") and "a_file" in m1
    assert max(s0, s1) < 30, (s0, s1)


def _evaluate_sharded_checkpoint(rank, work):
    from fsdp_common import BlockTrainer, fsdp_cfg

    ckpt = ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss")
    history = BlockTrainer(fsdp_cfg(strategy="fsdp", work_dir=work, num_epochs=1), callbacks=_recorders() + [ckpt]).run()
    fresh = BlockTrainer(fsdp_cfg(strategy="fsdp", work_dir=work, num_epochs=1, resume="auto"), callbacks=_recorders())
    untrained = fresh.evaluate()
    return ({k: v for k, v in history.last.items() if k.startswith("test/")}, untrained,
            fresh.evaluate(checkpoint=os.path.join(work, "model", "last.pth")), fresh.evaluate(checkpoint="auto"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sharded_last_pth_is_evaluated_under_fsdp_and_in_one_process(tmp_path):
    from fsdp_common import BlockTrainer, fsdp_cfg

    work = str(tmp_path / "w")
    results = run_distributed(_evaluate_sharded_checkpoint, 2, tmp_path, work, timeout=240)
    last = results[0][0]
    assert any(f.startswith("last-shards-") for f in os.listdir(os.path.join(work, "model")))   # a sharded save
    for trained, untrained, from_last, from_auto in results:
        assert trained == last and untrained != last and from_last == last and from_auto == last
    one = BlockTrainer(fsdp_cfg(work_dir=work, num_epochs=1, resume="auto", distributed=False), callbacks=_recorders())
    figures = one.evaluate(checkpoint=os.path.join(work, "model", "last.pth"))   # the shards read whole
    assert figures["test/Accuracy"] == last["test/Accuracy"]
    assert figures["test/loss"] == pytest.approx(last["test/loss"], rel=1e-5)


# ----------------------------------------------------------------------------- bounded memory
RSS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from conftest import ToyTrainer, toy_cfg

    class Expand(nn.Module):   # a float per sample in, 1,000 float32 out
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.linspace(0, 1, 1000))

        def forward(self, x):
            return x[:, :1] * self.w

    class T(ToyTrainer):
        def build_model(self, cfg, **kwargs):
            return Expand()

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    output, n = (sys.argv[1] if sys.argv[1] != "memory" else None), int(sys.argv[2])
    t = T(toy_cfg())
    data = TensorDataset(torch.arange(n, dtype=torch.float32)[:, None])
    warm = os.path.join(os.path.dirname(sys.argv[3]), "warm" + os.path.splitext(sys.argv[3])[1])
    t.predict(TensorDataset(torch.zeros(2000, 1)), output=warm if output else None, batch_size=1000)
    with open("/proc/self/clear_refs", "w") as f:   # the peak (VmHWM) starts again from here
        f.write("5")
    before = status("VmRSS")
    result = t.predict(data, output=output, batch_size=1000)
    growth = status("VmHWM") - before
    rows = len(result) if output is None else None
    print(json.dumps({{"growth": growth, "rows": rows, "size": os.path.getsize(output) if output else None}}))
""")


def _peak_growth(tmp_path, output, n):
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT.format(tests=TESTS))
    target = str(tmp_path / (output or "x.npz"))
    proc = subprocess.run([PY, str(script), target if output else "memory", str(n), target], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), target


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset through Linux's /proc")
@pytest.mark.parametrize("suffix", [".npz", ".npy"])
def test_streaming_400_mb_of_outputs_to_a_file_keeps_the_peak_rss_growth_under_100_mb(tmp_path, suffix):
    n = 100_000
    measured, path = _peak_growth(tmp_path, "out" + suffix, n)
    assert measured["size"] >= n * 1000 * 4   # 400 MB of float32 written
    assert measured["growth"] < 100 * 2 ** 20, measured
    if suffix == ".npz":
        with np.load(path, mmap_mode="r") as z:
            out = z["output"]
            assert out.shape == (n, 1000) and out[n - 1, 999] == np.float32(n - 1) and out[12345, 0] == 0.0
    else:
        out = np.load(path, mmap_mode="r")
        assert out.shape == (n, 1000) and out[n - 1, 999] == np.float32(n - 1) and out[12345, 0] == 0.0


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset through Linux's /proc")
def test_the_peak_rss_measure_sees_outputs_held_in_memory(tmp_path):
    # the control of the test above: the same 400 MB returned in memory do show in the measure
    measured, _ = _peak_growth(tmp_path, None, 100_000)
    assert measured["rows"] == 100_000 and measured["growth"] > 400 * 10 ** 6, measured


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset through Linux's /proc")
def test_streaming_a_csv_keeps_the_peak_rss_growth_under_100_mb(tmp_path):
    measured, path = _peak_growth(tmp_path, "out.csv", 20_000)   # 20 M values formatted (80 MB as float32)
    assert measured["growth"] < 100 * 2 ** 20, measured
    with open(path) as f:
        assert sum(1 for _ in f) == 1 + 20_000


# ----------------------------------------------------------------------------- bad input
def test_a_folder_holding_a_file_that_is_not_an_image_is_refused_before_any_forward(tmp_path):
    root = _images(tmp_path)
    (tmp_path / "images" / "b" / "notes.txt").write_text("not an image")
    t = RowTrainer(_cfg(), callbacks=_recorders())
    with pytest.raises(ValueError, match=r"notes\.txt.*is not an image file"):
        t.predict(root, output=str(tmp_path / "p.csv"), transform=flat16)
    assert not os.path.exists(tmp_path / "p.csv")
    with pytest.raises(FileNotFoundError, match="no_such_folder"):
        t.predict(str(tmp_path / "no_such_folder"), transform=flat16)


def test_a_folder_without_a_test_transform_to_read_it_with_is_refused(tmp_path):
    t = RowTrainer(_cfg(n_test=0), callbacks=_recorders())
    with pytest.raises(ValueError, match=r"test transform.*transform=\.\.\."):
        t.predict(_images(tmp_path))


def test_evaluate_without_test_data_names_build_test_loader_and_test_data(tmp_path):
    t = ToyTrainer(toy_cfg(n_test=0), callbacks=_recorders())
    with pytest.raises(ValueError, match=r"no test data.*build_test_loader.*test_data.*evaluate\(loader="):
        t.evaluate()


def test_a_checkpoint_that_does_not_exist_or_does_not_fit_is_a_clear_error(tmp_path):
    t = ToyTrainer(toy_cfg(n_test=N_TEST), callbacks=_recorders())
    with pytest.raises(FileNotFoundError, match="nothing_here.pth"):
        t.evaluate(checkpoint=str(tmp_path / "nothing_here.pth"))
    other = str(tmp_path / "six_classes.pth")
    torch.save(ToyTrainer(toy_cfg(num_classes=6)).unwrapped_model.state_dict(), other)
    with pytest.raises(ValueError, match=r"six_classes\.pth.*do not fit TinyNet.*shape mismatch: net\.2\.weight"):
        t.evaluate(checkpoint=other)
    with pytest.raises(ValueError, match=r"six_classes\.pth.*do not fit"):
        t.predict(t.test_loader, checkpoint=other)
    with pytest.raises(ValueError, match="checkpoint='auto'.*no checkpoint folder|checkpoint='auto'.*has none"):
        t.evaluate(checkpoint="auto")   # no work_dir, no ModelCheckpoint


def test_a_folder_given_as_checkpoint_suggests_a_file_that_is_in_it(tmp_path):
    """checkpoint=<work_dir>/model suggested '<work_dir>/model/model/last.pth', which does not exist
    (hostile pass)."""
    import time

    from basetrainer.runtime.errors import CheckpointError

    t = ToyTrainer(toy_cfg(n_test=N_TEST), callbacks=_recorders())
    model = tmp_path / "work" / "model"
    model.mkdir(parents=True)
    for name in ("model_001.pth", "best_model_002_0.5.pth", "last.pth"):
        torch.save(t.unwrapped_model.state_dict(), model / name)
        time.sleep(0.01)   # mtimes apart: the newest best is picked below
    with pytest.raises(CheckpointError, match=rf"^checkpoint file '{model}' is a folder, not a file: give the file "
                                              rf"inside it, e.g. '{model}/last\.pth'$"):
        t.predict(t.test_loader, checkpoint=str(model))
    with pytest.raises(CheckpointError, match=rf"e\.g\. '{model}/last\.pth'$"):   # a run's work_dir
        t.evaluate(checkpoint=str(tmp_path / "work"))
    (model / "last.pth").unlink()
    with pytest.raises(CheckpointError, match=rf"e\.g\. '{model}/best_model_002_0\.5\.pth'$"):
        t.evaluate(checkpoint=str(model))
    with pytest.raises(CheckpointError, match=r"holds no \.pth file: give the path of a checkpoint file"):
        t.evaluate(checkpoint=str(tmp_path / "work"))



class _Counting(RowTrainer):
    """RowTrainer counting its predict forwards (a refusal must come before any)."""
    forwards = 0

    def predict_step(self, batch):
        _Counting.forwards += 1
        return super().predict_step(batch)


def test_an_output_of_unknown_format_is_refused_before_any_forward(tmp_path):
    t = _Counting(_cfg(), callbacks=_recorders())
    _Counting.forwards = 0
    for name in ("p.txt", "p"):
        with pytest.raises(ValueError, match=rf"output='.*{name}'.*\.npy, \.npz, \.csv"):
            t.predict(t.test_loader, output=str(tmp_path / name))
    assert _Counting.forwards == 0 and os.listdir(tmp_path) == []
    # checked first, on every rank (under DDP only the main process opens the file)
    root = _images(tmp_path)
    (tmp_path / "images" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"output='.*p\.txt'"):
        t.predict(root, output=str(tmp_path / "p.txt"), transform=flat16)


class Score(RowTrainer):
    """A binary score: the second column of the softmax (a [n] slice of stride 4)."""

    def predict_step(self, batch):
        return self.model(batch[0]).softmax(1)[:, 1]


def test_a_score_column_with_a_batch_of_one_row_is_written_to_npy_and_npz(tmp_path):
    """10 samples, batch 3: the last batch's score is a [1] tensor of stride 4 (hostile pass: the
    .npy/.npz writers raised 'self.stride(-1) must be 1 to view Float as Byte')."""
    t = Score(_cfg(batch_size=3), callbacks=_recorders())
    data = blobs(10, 4, seed=1)
    expected = t.predict(data)
    assert expected.shape == (10,)
    assert np.array_equal(np.load(t.predict(data, output=str(tmp_path / "p.npy"))), expected.numpy())
    assert np.array_equal(np.load(t.predict(data, output=str(tmp_path / "p.npz")))["output"], expected.numpy())


def test_outputs_that_are_not_one_row_per_sample_are_refused_naming_the_counts(tmp_path):
    """A flattened output, a per-batch mean, a loader that does not batch (batch_size=None) and a
    flattened output to a folder's csv were taken as rows (or failed with a bare IndexError)."""
    class Step(RowTrainer):
        step = None

        def predict_step(self, batch):
            x = batch[0]
            return type(self).step(self.model(x) if x.dim() == 2 else self.model(x[None])[0])   # [4] unbatched

    t = Step(_cfg(batch_size=4), callbacks=_recorders())
    data = blobs(10, 4, seed=1)
    Step.step = staticmethod(lambda out: out.reshape(-1))
    with pytest.raises(ValueError, match=r"^predict\(\): predict_step returned 16 rows for a batch of 4 samples: "
                                         r".*return one row per sample"):
        t.predict(data)
    Step.step = staticmethod(lambda out: out.mean(0, keepdim=True))
    with pytest.raises(ValueError, match=r"returned 1 row for a batch of 4 samples"):
        t.predict(data, output=str(tmp_path / "mean.npy"))
    Step.step = staticmethod(lambda out: out)
    with pytest.raises(ValueError, match=r"returned 4 rows for a batch of 1 sample: the loader has batch_size=None"):
        t.predict(DataLoader(blobs(10, 4, seed=1), batch_size=None))
    Step.step = staticmethod(lambda out: out.reshape(-1))
    with pytest.raises(ValueError, match=r"returned 16 rows for a batch of 4 samples"):
        t.predict(_images(tmp_path), output=str(tmp_path / "flat.csv"), transform=flat16)
    assert sorted(os.listdir(tmp_path)) == ["images"]
    Step.step = staticmethod(lambda out: {"a": out, "b": out[:, 0]})   # one row per sample: fine
    assert t.predict(data)["b"].shape == (10,)


def test_an_output_path_that_cannot_be_a_file_is_refused_before_any_forward(tmp_path):
    """A folder named like a file failed only at the end, after every forward (IsADirectoryError
    on the temp's rename); a path under a file was a raw FileExistsError."""
    t = _Counting(_cfg(), callbacks=_recorders())
    _Counting.forwards = 0
    (tmp_path / "dir.npy").mkdir()
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(ValueError, match=r"^output='.*dir\.npy': .*dir\.npy is a folder: name a file "
                                         r"\(e\.g\. '.*dir\.npy/predictions\.npy'\)"):
        t.predict(t.test_loader, output=str(tmp_path / "dir.npy"))
    with pytest.raises(ValueError, match=r"^output='.*a_file/sub/p\.csv': .*a_file is a file, not a "
                                         r"folder: write the output elsewhere"):
        t.predict(t.test_loader, output=str(tmp_path / "a_file" / "sub" / "p.csv"))
    assert _Counting.forwards == 0 and sorted(os.listdir(tmp_path)) == ["a_file", "dir.npy"]
    assert os.listdir(tmp_path / "dir.npy") == []


class Checked(RowTrainer):
    """Counts its forwards; ``mode`` picks what predict_step returns."""

    mode, forwards = "scores", 0

    def predict_step(self, batch):
        Checked.forwards += 1
        out = self.model(batch[0])
        if Checked.mode == "flat":
            return out.reshape(-1)
        probs = out.softmax(1)
        return {"score": probs[:, 1], "both": (probs[:, 0], probs[:, 3])}


def _predict_checked(rank, work):
    t = Checked(_cfg(distributed=True, gpu_id=[0, 1], batch_size=4), callbacks=_recorders())
    data = blobs(9, 4, seed=1)   # 2 a batch a rank, shards of 5 and 4: rank 0 alone gives one row last
    Checked.mode = "scores"
    paths = [t.predict(data, output=os.path.join(work, "scores.npz"))]
    errors = []
    for mode, output in (("flat", None), ("scores", os.path.join(work, "dir.npy"))):
        Checked.mode, Checked.forwards = mode, 0
        try:
            t.predict(data, output=output)
            errors.append("no error")
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        errors.append(Checked.forwards)
    return paths, errors


@pytest.mark.distributed
def test_under_2_ranks_strided_scores_are_written_and_bad_rows_or_paths_refused_on_every_rank(tmp_path):
    """Hostile pass: dict/tuple score columns crashed the .npz writer under DDP; a flattened
    output's rows were interleaved wrongly, silently; a folder as output= failed after every
    forward. The path is checked before any rank's first forward."""
    (tmp_path / "dir.npy").mkdir()
    Checked.mode = "scores"
    one = Checked(_cfg(batch_size=4), callbacks=_recorders()).predict(blobs(9, 4, seed=1))
    (p0, e0), (p1, e1) = run_distributed(_predict_checked, 2, tmp_path, str(tmp_path), timeout=150)
    assert p0 == p1 == [str(tmp_path / "scores.npz")]
    with np.load(p0[0]) as z:
        assert sorted(z.files) == ["both.0", "both.1", "score"]
        assert np.array_equal(z["score"], one["score"].numpy()) and np.array_equal(z["both.1"], one["both"][1].numpy())
    flat = "ValueError: predict(): predict_step returned 8 rows for a batch of 2 samples"
    assert e0[0].startswith(flat) and e1[0].startswith(flat)   # each rank's own, before the gather
    assert e0[2].startswith("ValueError: output=") and "dir.npy is a folder" in e0[2]
    assert e1[2].startswith("RuntimeError: predict() failed on rank 0: ValueError: output=") and "is a folder" in e1[2]
    assert e0[3] == e1[3] == 0   # no forward on any rank


def test_loaders_that_lose_or_reorder_samples_are_refused(tmp_path):
    t = RowTrainer(_cfg(), callbacks=_recorders())
    data = blobs(N_TEST, 4, seed=1)
    for loader, why in ((DataLoader(data, batch_size=8, shuffle=True), "RandomSampler"),
                        (DataLoader(data, batch_size=8, drop_last=True), "drops its last incomplete batch")):
        with pytest.raises(ValueError, match=rf"{why}.*phase='test'"):
            t.predict(loader)
    padded = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    with pytest.raises(ValueError, match=r"pads 241 samples to 242.*twice"):
        t.evaluate(padded)


# ----------------------------------------------------------------------------- the examples
@pytest.mark.slow
@pytest.mark.distributed
def test_the_example_evaluates_and_predicts_a_trained_run(tmp_path):
    train = make_image_folder(str(tmp_path / "train"), ["ant", "bee", "cat"], per_class=8, size=16)
    val = make_image_folder(str(tmp_path / "val"), ["ant", "bee", "cat"], per_class=4, size=16)
    work = str(tmp_path / "work")
    common = ["--input_size", "32", "32", "--batch_size", "8", "--gpu_id", "--no-progress", "--num_workers", "0",
              "--net_type", "shufflenet_v2_x0_5", "--train_data", train, "--test_data", val, "--work_dir", work]

    def example(*args):
        proc = subprocess.run([PY, EXAMPLE, *common, *args], capture_output=True, text=True, timeout=240, cwd=tmp_path)
        return proc.returncode, proc.stdout + proc.stderr

    code, out = example("--num_epochs", "2", "--lr", "0.01")
    assert code == 0, out[-3000:]
    with open(os.path.join(work, "log", "history.csv"), newline="") as f:
        expected = float(list(csv.DictReader(f))[-1]["test/Accuracy"])
    code, out = example("--eval_only", "--resume", "auto")
    assert code == 0, out[-3000:]
    figure = next(line for line in out.splitlines() if line.startswith("evaluate: "))
    assert f"test/Accuracy {expected:.4f}" in figure and "(12 test samples)" in figure, figure
    best = next(f for f in os.listdir(os.path.join(work, "model")) if f.startswith("best_model_"))
    code, out = example("--eval_only", "--finetune", os.path.join(work, "model", best))   # the run's folder is not refused
    assert code == 0, out[-3000:]
    assert "evaluate: test/Accuracy" in out
    code, out = example("--predict", val, "--resume", "auto")
    assert code == 0, out[-3000:]
    path = os.path.join(work, "predict", "predictions.csv")
    assert f"predictions: {path}" in out
    rows = _csv(path)
    assert rows[0] == ["index", "id", "class", "probs_0", "probs_1", "probs_2"] and len(rows) == 13
    assert [r[1] for r in rows[1:4]] == ["ant/0.png", "ant/1.png", "ant/2.png"]
    code, out = example("--eval_only")
    assert code != 0 and "--resume auto" in out and "--finetune" in out
