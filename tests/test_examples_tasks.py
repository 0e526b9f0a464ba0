"""examples/segmentation.py and examples/regression.py trained end to end (subprocesses, one
process and 2-process DDP over gloo), their figures asserted, and their errors for bad flags."""
import csv
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

pytest.importorskip("torchmetrics")
pytest.importorskip("sklearn")

EXAMPLES = os.path.join(ROOT, "examples")
SEGMENTATION = os.path.join(EXAMPLES, "segmentation.py")
REGRESSION = os.path.join(EXAMPLES, "regression.py")
TIMEOUT = 240
# reduced segmentation: 2 epochs of 1,536 images (96 steps), no warm-up; the full run (README): 6 of 3,072
SEG_SMALL = ["--num_train", "1536", "--num_test", "256", "--num_epochs", "2", "--num_warn_up", "0",
             "--no-progress", "--log_freq", "50"]
SHAPES = ["circle", "square", "triangle"]


def _start(script, args, cwd):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, script, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _run_all(root, commands):
    """Start the commands at once (much of their time is importing); ``{name: (code, output)}``."""
    procs = {name: _start(script, args, str(root)) for name, (script, args) in commands.items()}
    results = {}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=TIMEOUT)
            results[name] = (proc.returncode, out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.fixture(scope="module")
def seg_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("segmentation")
    return root, _run_all(root, {
        "seg": (SEGMENTATION, [*SEG_SMALL, "--gpu_id", "--work_dir", str(root / "seg")]),
        "seg_ddp": (SEGMENTATION, [*SEG_SMALL, "--distributed", "--work_dir", str(root / "seg_ddp")]),
    })


@pytest.fixture(scope="module")
def reg_runs(tmp_path_factory):
    """The regression's full configuration: a few seconds of training."""
    root = tmp_path_factory.mktemp("regression")
    return root, _run_all(root, {
        "reg": (REGRESSION, ["--gpu_id", "--num_threads", "1", "--work_dir", str(root / "reg")]),
        "reg_ddp": (REGRESSION, ["--distributed", "--work_dir", str(root / "reg_ddp")]),
    })


def _history(work_dir):
    with open(os.path.join(work_dir, "log", "history.csv"), newline="") as f:
        return list(csv.DictReader(f))


def _seg_figures(root, results, name):
    code, out = results[name]
    assert code == 0, out[-4000:]
    match = re.search(r"final test/IoU: background (\d\.\d{4}), circle (\d\.\d{4}), square (\d\.\d{4}), "
                      r"triangle (\d\.\d{4}); min over shapes (\d\.\d{4}); mean IoU (\d\.\d{4}) \(best (\d\.\d{4})\) "
                      r"after 2 epochs", out)
    assert match, out[-4000:]
    printed = [float(v) for v in match.groups()]
    rows = _history(root / name)
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    last = rows[-1]
    per_class = [float(last[f"test/IoU_{i}"]) for i in range(4)]
    assert printed[:4] == pytest.approx(per_class, abs=5e-5)
    assert float(last["test/IoU"]) == pytest.approx(sum(per_class) / 4, abs=1e-6)    # mean IoU = their mean
    # the dict of losses: each head's loss and their sum
    assert float(last["train/loss"]) == pytest.approx(float(last["train/main"]) + float(last["train/aux"]), rel=1e-5)
    assert float(last["train/aux"]) > 0
    return per_class, rows


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["seg", "seg_ddp"])
def test_segmentation_learns_every_shape(seg_runs, name):
    """After 96 steps the shapes are found (background IoU >= 0.85) but not yet told apart well:
    measured 0.92 for the background and 0.30 / 0.12 / 0.00 for circle / square / triangle
    (mean over shapes 0.14), so the bar is a mean over shapes >= 0.1. The full run (README,
    bench/readme_figures.py) takes every shape to >= 0.5."""
    root, results = seg_runs
    per_class, rows = _seg_figures(root, results, name)
    figures = dict(zip(["background", *SHAPES], per_class))
    assert per_class[0] >= 0.85, figures
    assert sum(per_class[1:]) / 3 >= 0.1, figures
    assert float(rows[-1]["train/loss"]) < float(rows[0]["train/loss"])
    best = [f for f in os.listdir(root / name / "model") if f.startswith("best_model_")]
    ious = [float(r["test/IoU"]) for r in rows]
    assert best == [f"best_model_{ious.index(max(ious)):03d}_{max(ious):.4f}.pth"]    # by the highest mean IoU
    if name == "seg_ddp":
        assert "processes: 2" in results[name][1]


def _reg_figures(root, results, name):
    code, out = results[name]
    assert code == 0, out[-4000:]
    match = re.search(r"final test/R2: (-?\d\.\d{4}) test/MAE: (\d+\.\d{4}) .*linear regression baseline R2: "
                      r"(\d\.\d{4}) MAE: (\d+\.\d{4}); 50 epochs", out)
    assert match, out[-4000:]
    return [float(v) for v in match.groups()], _history(root / name)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["reg", "reg_ddp"])
def test_regression_matches_the_linear_baseline(reg_runs, name):
    root, results = reg_runs
    (r2, mae, linear_r2, linear_mae), rows = _reg_figures(root, results, name)
    assert linear_r2 == pytest.approx(0.4713, abs=1e-4)      # least squares on the fixed split
    assert r2 >= linear_r2, (r2, linear_r2)
    assert float(rows[-1]["test/R2"]) == pytest.approx(r2, abs=5e-5)
    assert float(rows[-1]["test/MAE"]) == pytest.approx(mae, abs=5e-5)
    maes = [float(r["test/MAE"]) for r in rows]
    best = [f for f in os.listdir(root / name / "model") if f.startswith("best_model_")]
    assert best == [f"best_model_{maes.index(min(maes)):03d}_{min(maes):.4f}.pth"]   # the lowest MAE: mode "min"
    if name == "reg_ddp":
        assert "processes: 2" in results[name][1]


@pytest.mark.distributed
@pytest.mark.slow
def test_regression_ddp_equals_one_process(reg_runs):
    """353 train samples (batches of 32: the last holds 1) and 89 test samples on 2 ranks:
    every epoch's figures equal one process's."""
    root, results = reg_runs
    single, ddp = _reg_figures(root, results, "reg")[1], _reg_figures(root, results, "reg_ddp")[1]
    assert len(single) == len(ddp) == 50
    for key in ("test/MAE", "test/R2", "train/MAE", "train/loss"):
        a = [float(r[key]) for r in single]
        b = [float(r[key]) for r in ddp]
        scale = 1e-3 if key == "train/loss" else 1e-5     # the loss is in units² (about 3,000)
        assert max(abs(x - y) for x, y in zip(a, b)) <= scale, key
    weights_single = torch.load(root / "reg" / "model" / "last.pth", weights_only=True)["model"]
    weights_ddp = torch.load(root / "reg_ddp" / "model" / "last.pth", weights_only=True)["model"]
    for key, value in weights_single.items():
        assert torch.allclose(value, weights_ddp[key], atol=1e-5), key


def _load(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3] + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--num_epochs", "0"], "--num_epochs must be > 0, got '0'"),
    (["--image_size", "30"], "--image_size 30: the U-Net halves the image three times; use a multiple of 8"),
    (["--batch_size", "x"], "--batch_size must be an integer, got 'x'"),
    (["--net_type", "unet3"], "invalid choice: 'unet3'"),
])
def test_segmentation_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _load(SEGMENTATION).parse_config(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--depth", "-1"], "--depth must be >= 0, got '-1'"),
    (["--activation", "sigmoidal"], "invalid choice: 'sigmoidal'"),
])
def test_regression_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _load(REGRESSION).parse_config(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("script, own", [(REGRESSION, set()), (SEGMENTATION, {"net_type"})],
                         ids=["regression", "segmentation"])
def test_every_key_of_the_config_table_is_a_flag_of_the_task_examples(script, own):
    """As for examples/example.py (issue 35: --sync_bn was YAML-only); ``own``: keys the script
    declares with its own choices (the U-Nets for net_type)."""
    from basetrainer.utils import setup_config

    sys.path.insert(0, os.path.dirname(__file__))
    from test_example import _flag

    module = _load(script)
    assert "--sync_bn" in module.get_parser().format_help()
    for key, (default, kind, _) in setup_config.ENGINE_KEYS.items():
        if key in own:
            continue
        argv, expected = _flag(key, kind, default)
        assert module.parse_config(argv)[key] == expected, (key, argv)


def test_shapes_are_seeded_by_sample():
    shapes = _load(SEGMENTATION)
    a = shapes.SyntheticShapes(8, 32, seed=5, split="train")
    b = shapes.SyntheticShapes(100, 32, seed=5, split="train")
    for i in (0, 7):
        torch.manual_seed(i)     # the global generator plays no part
        first = a[i]
        assert torch.equal(first["image"], b[i]["image"]) and torch.equal(first["mask"], b[i]["mask"])
    assert not torch.equal(a[0]["mask"], shapes.SyntheticShapes(8, 32, seed=5, split="test")[0]["mask"])
    assert not torch.equal(a[0]["image"], shapes.SyntheticShapes(8, 32, seed=6, split="train")[0]["image"])
    masks = torch.stack([a[i]["mask"] for i in range(8)])
    assert set(masks.unique().tolist()) == {0, 1, 2, 3}
    assert a[0]["image"].shape == (3, 32, 32) and a[0]["mask"].dtype == torch.long


@pytest.mark.distributed
@pytest.mark.slow
def test_regression_summary_after_a_resume_covers_the_whole_run(tmp_path):
    """run() returns the epochs of its own call: after a resume the example's summary takes the
    lowest MAE and the epoch count from the whole run (it once said "at epoch 1 ... 2 epochs")."""
    work = tmp_path / "reg"
    first = _run_all(tmp_path, {"a": (REGRESSION, ["--num_epochs", "4", "--work_dir", str(work)])})["a"]
    assert first[0] == 0, first[1][-4000:]
    code, out = _run_all(tmp_path, {"b": (REGRESSION, ["--num_epochs", "6", "--resume", "auto",
                                                       "--work_dir", str(work)])})["b"]
    assert code == 0, out[-4000:]
    maes = [float(r["test/MAE"]) for r in _history(work)]
    assert len(maes) == 6
    assert f"(lowest MAE {min(maes):.4f} at epoch {maes.index(min(maes))}" in out
    assert "; 6 epochs (2 in this call) in" in out
