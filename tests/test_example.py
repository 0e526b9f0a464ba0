"""examples/example.py end to end (a subprocess on a tiny ImageFolder), its errors for bad
inputs, and examples/prepare_data.prepare_digits."""
import csv
import glob
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import ROOT, make_image_folder

EXAMPLE = os.path.join(ROOT, "examples", "example.py")
CLASSES = ["ant", "bee", "cat"]
COMMON = ["--input_size", "32", "32", "--batch_size", "8", "--gpu_id", "--no-progress", "--num_workers", "0"]


def _start(args, cwd):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, EXAMPLE, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every example process at once (they spend most of their time importing)."""
    root = tmp_path_factory.mktemp("example")
    train = make_image_folder(str(root / "train"), CLASSES, per_class=8, size=16)
    val = make_image_folder(str(root / "val"), CLASSES, per_class=4, size=16)
    one_class = make_image_folder(str(root / "one"), ["only"], per_class=4, size=16)
    work = str(root / "work")
    procs = {
        "train": _start(["--train_data", train, "--test_data", val, "--net_type", "shufflenet_v2_x0_5",
                         "--num_epochs", "2", "--lr", "0.01", "--log_freq", "1", "--work_dir", work, *COMMON],
                        cwd=str(root)),
        "fsdp": _start(["--train_data", train, "--test_data", val, "--net_type", "shufflenet_v2_x0_5",
                        "--num_epochs", "2", "--lr", "0.01", "--work_dir", str(root / "fsdp"), "--distributed",
                        "--strategy", "fsdp", *COMMON, "--gpu_id", "0", "1"], cwd=str(root)),
        "missing": _start(["--train_data", str(root / "no_such_folder"), "--work_dir", str(root / "w1"), *COMMON],
                          cwd=str(root)),
        "one_class": _start(["--train_data", one_class, "--work_dir", str(root / "w2"), *COMMON], cwd=str(root)),
        "net_type": _start(["--train_data", train, "--net_type", "resnet_18_typo", "--work_dir", str(root / "w3"),
                            *COMMON], cwd=str(root)),
    }
    results = {}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=240)
            results[name] = (proc.returncode, out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return root, results


@pytest.mark.distributed
@pytest.mark.slow
def test_example_trains_and_writes_its_files(runs):
    root, results = runs
    code, out = results["train"]
    assert code == 0, out
    work = root / "work"
    match = re.search(r"final test/Accuracy: (\d\.\d{4}) \(best (\d\.\d{4})\) after 2 epochs", out)
    assert match, out

    with open(work / "log" / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    accuracies = [float(r["test/Accuracy"]) for r in rows]
    assert all(a * 12 == pytest.approx(round(a * 12)) for a in accuracies)   # 12 test images
    assert float(match.group(1)) == pytest.approx(accuracies[-1], abs=5e-5)
    assert float(match.group(2)) == pytest.approx(max(accuracies), abs=5e-5)

    best = glob.glob(str(work / "model" / "best_model_*.pth"))
    assert len(best) == 1
    best_epoch = accuracies.index(max(accuracies))      # first epoch reaching the best
    assert os.path.basename(best[0]) == f"best_model_{best_epoch:03d}_{max(accuracies):.4f}.pth"
    weights = torch.load(best[0], weights_only=True)
    assert weights["fc.weight"].shape == (3, 1024)      # the head sized for 3 classes

    last = torch.load(work / "model" / "last.pth", weights_only=True)
    assert last["epoch"] == 1 and last["global_step"] == 2 * 3      # 24 images / batch 8, drop_last
    assert last["config"]["classes"] == CLASSES

    saved = yaml.safe_load(open(work / "setup_config.yaml"))
    assert saved["num_epochs"] == 2 and saved["input_size"] == [32, 32] and saved["gpu_id"] == []
    assert saved["net_type"] == "shufflenet_v2_x0_5" and saved["lr"] == 0.01
    assert saved["momentum"] == 0.9 and saved["scheduler"] == "cosine"   # from configs/config.yaml
    assert os.path.isfile(work / "log" / "train.log") and os.path.isfile(work / "log" / "history.png")
    assert "epoch 1/2 done" in open(work / "log" / "train.log").read()


@pytest.mark.distributed
@pytest.mark.slow
def test_example_trains_sharded_with_one_flag(runs):
    root, results = runs
    code, out = results["fsdp"]
    assert code == 0, out
    match = re.search(r"final test/Accuracy: (\d\.\d{4}) \(best (\d\.\d{4})\) after 2 epochs", out)
    assert match, out
    folder = root / "fsdp" / "model"
    last = torch.load(folder / "last.pth", weights_only=True)
    assert last["world_size"] == 2 and last["config"]["strategy"] == "fsdp"
    assert sorted(os.listdir(folder / last["shards"])) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    best = glob.glob(str(folder / "best_model_*.pth"))
    assert len(best) == 1   # the whole weights in one ordinary file, as under ddp
    weights = torch.load(best[0], weights_only=True)
    assert weights["fc.weight"].shape == (3, 1024) and all(isinstance(v, torch.Tensor) for v in weights.values())


@pytest.mark.distributed
def test_missing_train_data_names_the_key(runs):
    root, results = runs
    code, out = results["missing"]
    assert code != 0
    assert "train_data" in out and "no_such_folder" in out and "does not exist" in out


@pytest.mark.distributed
def test_single_class_folder_is_refused(runs):
    _, results = runs
    code, out = results["one_class"]
    assert code != 0
    assert "train_data" in out and "only one class" in out


@pytest.mark.distributed
def test_unknown_net_type_lists_valid_names(runs):
    _, results = runs
    code, out = results["net_type"]
    assert code != 0
    assert "unknown net_type 'resnet_18_typo'" in out
    assert "resnet18" in out and "mobilenet_v2" in out


def test_prepare_digits(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from prepare_data import prepare_digits
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    root = str(tmp_path / "digits")
    assert prepare_digits(root) == root
    counts = {split: {c: len(os.listdir(os.path.join(root, split, c))) for c in os.listdir(os.path.join(root, split))}
              for split in ("train", "val")}
    assert sorted(counts["train"]) == sorted(counts["val"]) == [str(d) for d in range(10)]
    assert sum(counts["train"].values()) == 1437 and sum(counts["val"].values()) == 360
    assert sum(counts["train"].values()) + sum(counts["val"].values()) == 1797
    assert min(counts["val"].values()) >= 35      # stratified: every digit about 36 times
    assert open(os.path.join(root, ".done")).read() == "1437 train, 360 val\n"
    assert glob.glob(root + ".tmp*") == []

    sample = glob.glob(os.path.join(root, "train", "3", "*.png"))[0]
    stamp = os.path.getmtime(sample)
    assert prepare_digits(root) == root                 # second call: nothing rewritten
    assert os.path.getmtime(sample) == stamp
    assert len(glob.glob(os.path.join(root, "*", "*", "*.png"))) == 1797


def test_prepare_digits_from_three_processes_at_once(tmp_path):
    """Test workers and ranks may prepare the data at the same moment: each gets the whole folder."""
    root = str(tmp_path / "digits")
    code = f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'examples')!r}); " \
           f"from prepare_data import prepare_digits; prepare_digits({root!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    assert len(glob.glob(os.path.join(root, "*", "*", "*.png"))) == 1797
    assert open(os.path.join(root, ".done")).read() == "1437 train, 360 val\n"
    assert glob.glob(root + ".tmp*") == []


# ------------------------------------------------------------------------------ every documented key is a flag
# a value of each key other than its default (and valid: parse_config checks them)
FLAG_VALUES = {"work_dir": "elsewhere", "net_type": "mobilenet_v2", "optim_type": "Adam", "loss_type": "FocalLoss",
               "scheduler": "step", "amp": "bf16", "loss_reduction": "sum", "balance": "sqrt", "strategy": "fsdp",
               "schedule_on_resume": "restart", "test_data": ["v1", "v2"], "gpu_id": [0, 1],
               "milestones": [2, 4], "input_size": [48, 40], "pretrained": True,
               "fsdp_meta_init": "true", "fsdp_wrap": ["Block"], "loggers": ["csv"], "mlflow_uri": "sqlite:///m.db"}
SAMPLES = {"str": "x", "int": 3, "optint": 5, "number": 0.25, "optpath": "weights.pth", "path": ["d"],
           "ints": [1], "strs": ["A"], "loggers": ["csv"], "autobool": "false", "boolpath": "w.pth", "size": [8, 8]}


def _flag(key, kind, default):
    """``(argv, expected value)`` for the flag of ``key``."""
    if kind == "bool":
        return ([f"--no-{key}"] if default else [f"--{key}"]), not default
    value = FLAG_VALUES.get(key, SAMPLES[kind])
    text = ["none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
            for v in (value if isinstance(value, list) else [value])]
    return [f"--{key}"] + text, value


def test_every_key_of_the_config_table_is_a_flag_of_the_example():
    from basetrainer.utils import setup_config

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import example

    assert "--sync_bn" in example.get_parser().format_help()   # and --help shows them (issue 35: sync_bn was YAML-only)
    for key, (default, kind, _) in setup_config.ENGINE_KEYS.items():
        if key == "train_data":
            continue   # given to every parse below (else the digits are made)
        argv, expected = _flag(key, kind, default)
        cfg = example.parse_config(["--train_data", "t"] + argv)
        assert cfg[key] == expected, (key, argv, cfg[key])
        assert cfg[key] != setup_config.engine_defaults()[key] or key == "work_dir", key   # the flag did it


def test_the_example_lets_launch_pick_a_free_port(monkeypatch, tmp_path):
    """With dist_url tcp://127.0.0.1:28661 fixed, two DDP runs started at once on one machine
    collided: the second's rank joined the first's store and the first, healthy run was killed
    (hostile pass). regression.py and segmentation.py already said "auto"."""
    import runpy

    from basetrainer.engine import launch as launch_module

    calls = []
    monkeypatch.setattr(launch_module, "launch", lambda main, **kw: calls.append(kw))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    monkeypatch.setattr(sys, "argv", [EXAMPLE, "--train_data", str(tmp_path), "--distributed", "--gpu_id", "0", "1"])
    runpy.run_path(EXAMPLE, run_name="__main__")
    assert [(c["dist_url"], c["num_machines"], c["num_gpus_per_machine"]) for c in calls] == [("auto", 1, 2)]


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_of_a_finished_run_says_so_and_prints_its_figure(runs):
    root, results = runs
    code, out = results["train"]
    assert code == 0, out
    figure = re.search(r"final test/Accuracy: \d\.\d{4} \(best \d\.\d{4}\) after 2 epochs", out).group(0)
    again = _start(["--train_data", str(root / "train"), "--test_data", str(root / "val"), "--net_type",
                    "shufflenet_v2_x0_5", "--num_epochs", "2", "--lr", "0.01", "--log_freq", "1", "--work_dir",
                    str(root / "work"), "--resume", "auto", *COMMON], cwd=str(root))
    out, _ = again.communicate(timeout=240)
    assert again.returncode == 0, out
    lines = out.splitlines()
    said = [x for x in lines if "nothing left to train" in x]
    assert len(said) == 1 and said[0].endswith(f"the run in {root / 'work'} finished all 2 epochs (last.pth): "
                                               f"nothing left to train; raise num_epochs to train on"), out
    assert not [x for x in lines if "resumed at epoch" in x or "continuing at epoch" in x], out
    assert lines[-1].startswith(figure), out    # the run's figure again (before: nothing)
