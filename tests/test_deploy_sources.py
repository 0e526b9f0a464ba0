"""What an export starts from: the files a training run writes (weights, last.pth, its EMA, a
sharded last.pth, a pruned model) and models inside training wrappers; bad ones are refused
before a file is written. And the command line: its table, JSON and exit codes."""
import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.callbacks.model_ema import ModelEMA
from basetrainer.deploy.__main__ import main as cli
from basetrainer.deploy.export import export_model
from basetrainer.deploy.source import load_model
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from basetrainer.models.build_models import get_models
from basetrainer.runtime import atomic
from basetrainer.utils import setup_config
from conftest import ROOT, ToyTrainer, free_port, make_image_folder, run_distributed, toy_cfg, weight_diff

SIZE = 16


def images(n: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, SIZE, SIZE)).astype(np.float32)


def eager(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(x)).numpy()


def onnx_outputs(path: str, x: np.ndarray) -> np.ndarray:
    from basetrainer.engine.onnx_engine import ONNXEngine

    return ONNXEngine(path, use_gpu=False)(x)[0]


class ImageTrainer(ToyTrainer):
    """resnet18 on 16x16 random images, 4 classes: writes what the example writes."""

    def build_train_loader(self, cfg, **kwargs):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 3, SIZE, SIZE, generator=g), torch.arange(32) % 4)
        return self.build_dataloader(data, cfg.batch_size, 0, phase="train", shuffle=True)

    def build_test_loader(self, cfg, **kwargs):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(8, 3, SIZE, SIZE, generator=g), torch.arange(8) % 4)
        return self.build_dataloader(data, cfg.batch_size, 0, phase="test", shuffle=False)

    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        return self.build_model_parallel(get_models(cfg.net_type, cfg.input_size, cfg.num_classes), cfg.gpu_id,
                                         distributed=cfg.distributed)


def train(work: str, ema: bool = False, evaluate: bool = False, **over):
    settings = dict(net_type="resnet18", input_size=[SIZE, SIZE], num_classes=4, num_epochs=1, batch_size=8, lr=0.01)
    cfg = toy_cfg(work_dir=work, **{**settings, **over})
    callbacks = ([ModelEMA(decay=0.5, evaluate=evaluate)] if ema else []) + [
        AccuracyRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="Accuracy",
                                            async_save=False)]
    t = ImageTrainer(cfg, callbacks=callbacks)
    t.run()
    return t, callbacks


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("run"))
    t, callbacks = train(work, ema=True)
    best = next(n for n in os.listdir(os.path.join(work, "model")) if n.startswith("best_model_"))
    return SimpleNamespace(work=work, model=t.model, ema=callbacks[0].ema, best=os.path.join(work, "model", best),
                           last=os.path.join(work, "model", "last.pth"))


@pytest.mark.slow
def test_last_pth_names_its_model(run, tmp_path):
    x = images()
    report = export_model(run.last, "onnx", out_dir=str(tmp_path), check=x, runs=0, name="m")
    assert report.input_shape == [1, 3, SIZE, SIZE]
    assert report.source == "last.pth (resnet18, 4 classes)"
    assert np.abs(onnx_outputs(str(tmp_path / "m.onnx"), x) - eager(run.model, x)).max() <= 1e-4


@pytest.mark.slow
def test_weights_file_with_and_without_its_run_config(run, tmp_path):
    x = images()
    with pytest.raises(ValueError, match=r"holds weights only and names no model: pass net_type \(--net-type"):
        export_model(run.best, "onnx", out_dir=str(tmp_path / "a"), runs=0)
    export_model(run.best, "onnx", out_dir=str(tmp_path / "b"), net_type="resnet18", input_size=[SIZE, SIZE],
                 check=x, runs=0, name="m")                   # num_classes read from the weights
    assert np.abs(onnx_outputs(str(tmp_path / "b" / "m.onnx"), x) - eager(run.model, x)).max() <= 1e-4
    # the example saves its config as <work_dir>/setup_config.yaml: found from <work_dir>/model/<weights>
    copy_dir = tmp_path / "run2"
    (copy_dir / "model").mkdir(parents=True)
    (copy_dir / "model" / "best.pth").write_bytes(open(run.best, "rb").read())
    setup_config.save_config(setup_config.Config(net_type="resnet18", input_size=[SIZE, SIZE], num_classes=4),
                             str(copy_dir / "setup_config.yaml"))
    src = load_model(str(copy_dir / "model" / "best.pth"))
    assert (src.net_type, src.num_classes, src.input_size) == ("resnet18", 4, [SIZE, SIZE])


@pytest.mark.slow
def test_ema_weights_of_a_resumable_checkpoint(run, tmp_path):
    src = load_model(run.last, weights="ema")
    assert all(torch.equal(src.model.state_dict()[k], v.cpu()) for k, v in run.ema.items())
    assert not torch.equal(src.model.state_dict()["fc.weight"], load_model(run.last).model.state_dict()["fc.weight"])
    with pytest.raises(ValueError, match="holds no ModelEMA average"):
        load_model(run.best, net_type="resnet18", input_size=[SIZE, SIZE], weights="ema")


@pytest.mark.slow
def test_weights_of_another_architecture(run, tmp_path):
    with pytest.raises(ValueError, match=r"do not fit MobileNetV2.*--net-type, --num-classes; now 'mobilenet_v2'"):
        export_model(run.last, "onnx", net_type="mobilenet_v2", out_dir=str(tmp_path / "out"), runs=0)
    with pytest.raises(ValueError, match=r"shape mismatch: fc.weight: file \(4, 512\) vs model \(10, 512\)"):
        export_model(run.best, "onnx", net_type="resnet18", num_classes=10, input_size=[SIZE, SIZE],
                     out_dir=str(tmp_path / "out"), runs=0)
    assert not (tmp_path / "out").exists()


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint '.*nope.pth' does not exist; pass the path"):
        export_model(str(tmp_path / "nope.pth"), "onnx", out_dir=str(tmp_path / "out"))
    (tmp_path / "cut.pth").write_bytes(b"PK\x03\x04 half a file")
    with pytest.raises(ValueError, match=r"cut.pth' is truncated or not a torch file"):
        export_model(str(tmp_path / "cut.pth"), "onnx", out_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="is a folder; pass a file"):
        export_model(str(tmp_path), "onnx", out_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


class ModelEmaV3(nn.Module):
    """A timm-style EMA wrapper: the averaged model in ``.module``."""

    def __init__(self, model):
        super().__init__()
        self.module = copy.deepcopy(model)


@pytest.mark.slow
def test_wrapped_models_are_unwrapped(run, tmp_path):
    import torch.distributed as dist
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    inner = copy.deepcopy(run.model).eval()
    x = images()
    want = eager(inner, x)
    averaged = AveragedModel(inner, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema_cb = ModelEMA()
    ema_cb.trainer = SimpleNamespace(model=nn.DataParallel(inner))
    ema_cb.ema = {k: v.clone() for k, v in inner.state_dict().items()}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        wrapped = {"dp": nn.DataParallel(inner), "ddp": nn.parallel.DistributedDataParallel(inner),
                   "compile": torch.compile(inner), "swa-ema": averaged, "timm-ema": ModelEmaV3(inner),
                   "ModelEMA": ema_cb}
        for name, model in wrapped.items():
            export_model(model, "onnx", out_dir=str(tmp_path), input_size=[SIZE, SIZE], check=x, runs=0, name=name)
            assert np.abs(onnx_outputs(str(tmp_path / f"{name}.onnx"), x) - want).max() <= 1e-4, name
    finally:
        dist.destroy_process_group()


def _pruned_run(work: str):
    from basetrainer.pruning.nni_pruning import model_pruning

    torch.manual_seed(0)
    model = model_pruning(get_models("resnet18", [SIZE, SIZE], 4), [SIZE, SIZE], sparsity=0.5,
                          output_prune=os.path.join(work, "prune"))
    with torch.no_grad():                                     # "trained" after pruning
        model.fc.weight.add_(0.1)
    atomic.write_atomically(model.state_dict(), os.path.join(work, "model", "best_model_000_0.5.pth"))
    setup_config.save_config(setup_config.Config(net_type="resnet18", input_size=[SIZE, SIZE], num_classes=4,
                                                 work_dir=work, use_prune=True), os.path.join(work, "setup_config.yaml"))
    return model.eval()


@pytest.mark.slow
def test_pruned_model_exports_with_its_smaller_shapes(tmp_path):
    work = str(tmp_path / "run")
    pruned = _pruned_run(work)
    x = images()
    best = os.path.join(work, "model", "best_model_000_0.5.pth")
    report = export_model(best, "onnx", out_dir=str(tmp_path / "out"), check=x, runs=0, name="m")
    assert report.rows[0].size_bytes < 0.5 * 4 * 11.2e6                    # well under the dense 11 M floats
    assert np.abs(onnx_outputs(str(tmp_path / "out" / "m.onnx"), x) - eager(pruned, x)).max() <= 1e-4
    src = load_model(os.path.join(work, "prune", "pruned_model.pth"), net_type="resnet18", input_size=[SIZE, SIZE])
    assert src.model.conv1.out_channels == pruned.conv1.out_channels < 64
    with pytest.raises(ValueError, match=r"is a pruned model's file and holds no ModelEMA average"):
        load_model(os.path.join(work, "prune", "pruned_model.pth"), net_type="resnet18", input_size=[SIZE, SIZE],
                   weights="ema")
    os.rename(os.path.join(work, "prune"), os.path.join(work, "elsewhere"))
    with pytest.raises(ValueError, match=r"shape mismatch.*--pruned <work_dir>/prune/pruned_model.pth"):
        load_model(best)
    assert load_model(best, pruned=os.path.join(work, "elsewhere")).model.conv1.out_channels < 64


def _fsdp_train(rank, work):
    train(work, strategy="fsdp", distributed=True)
    return rank


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_last_pth(tmp_path):
    work = str(tmp_path / "run")
    run_distributed(_fsdp_train, 2, tmp_path, work, timeout=300)
    last = os.path.join(work, "model", "last.pth")
    from basetrainer.runtime import checkpoint

    assert checkpoint.load_file(last)["shards"]                 # a sharded checkpoint's pointer file
    best = next(n for n in os.listdir(os.path.join(work, "model")) if n.startswith("best_model_"))
    x = images()
    export_model(last, "onnx", out_dir=str(tmp_path / "out"), check=x, runs=0, name="m")
    reference = load_model(os.path.join(work, "model", best), net_type="resnet18", input_size=[SIZE, SIZE]).model
    assert np.abs(onnx_outputs(str(tmp_path / "out" / "m.onnx"), x) - eager(reference, x)).max() <= 1e-4


def _fsdp_ema_train(rank, work):
    # convnext_tiny: a torchvision model without BatchNorm (fsdp + ModelEMA + BatchNorm is issue 31.10)
    train(work, ema=True, evaluate=True, strategy="fsdp", distributed=True, net_type="convnext_tiny")
    return rank


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_last_pth_exports_the_ema_average(tmp_path):
    """A sharded last.pth with --weights ema gives ModelEMA's average (gathered from its shards),
    not the live weights; the best file (ModelEMA(evaluate=True): the average) is the reference."""
    work = str(tmp_path / "run")
    run_distributed(_fsdp_ema_train, 2, tmp_path, work, timeout=600)
    folder = os.path.join(work, "model")
    last = os.path.join(folder, "last.pth")
    best = os.path.join(folder, next(n for n in os.listdir(folder) if n.startswith("best_model_")))
    average = load_model(best, net_type="convnext_tiny", input_size=[SIZE, SIZE]).model.state_dict()
    ema = load_model(last, weights="ema")
    live = load_model(last, weights="model").model.state_dict()
    assert ema.description == "last.pth (convnext_tiny, 4 classes)"
    assert weight_diff(ema.model.state_dict(), average) == 0.0
    assert weight_diff(live, average) > 1e-3


# ----------------------------------------------------------------------------- the command line
@pytest.mark.slow
def test_command_line_table_json_and_exit_codes(run, tmp_path, capsys, monkeypatch):
    val = make_image_folder(str(tmp_path / "val"), ["a", "b", "c", "d"], per_class=3, size=SIZE)
    out = tmp_path / "out"
    args = [run.last, "--format", "onnx,openvino", "--input-size", str(SIZE), str(SIZE), "--check", val,
            "--out-dir", str(out), "--runs", "2", "--warmup", "1", "--batch", "5"]
    assert cli(args) == 0
    table = capsys.readouterr().out
    assert "checked on 12 " in table and "| openvino | OpenVINO | fp32 | last.xml, last.bin |" in table
    saved = json.loads((out / "last.export.json").read_text())
    assert saved["ok"] is True and [r["format"] for r in saved["rows"]] == ["pytorch", "onnx", "openvino"]
    onnx_row = saved["rows"][1]
    assert onnx_row["parity"]["samples"] == 12 and onnx_row["parity"]["agreement"] == 1.0
    assert onnx_row["parity"]["max_abs"] <= 1e-4 and onnx_row["latency"]["batch 5"]["runs"] == 2
    # a format outside its bound: exit 1, the table shows why, its file is not written
    from basetrainer.deploy import parity

    monkeypatch.setitem(parity.BOUNDS, "fp32", parity.Bound(rel=0.0, min_agreement=1.0))
    assert cli([run.last, "--format", "onnx", "--check", val, "--out-dir", str(tmp_path / "strict"), "--runs", "0"]) == 1
    captured = capsys.readouterr()
    assert "**FAIL**: max |Δ| " in captured.out and "error: export failed for onnx: outside its bound: max |Δ|" in captured.err
    assert sorted(os.listdir(tmp_path / "strict")) == ["last.export.json", "last.export.md"]


@pytest.mark.distributed
def test_command_line_bad_arguments_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "basetrainer.deploy", str(tmp_path / "missing.pth"), "--format",
                           "onnx,tflite"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("error: unknown format 'tflite'; choose from ['mnn', 'ncnn', 'ncnn-fp16', "
                                   "'onnx', 'onnx-fp16', 'onnx-int8', 'openvino', 'rknn', 'tensorrt'] "
                                   "(comma-separated, e.g. --format onnx,mnn,ncnn,openvino)")
    proc = subprocess.run([sys.executable, "-m", "basetrainer.deploy", str(tmp_path / "missing.pth"), "--format",
                           "onnx"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "missing.pth' does not exist" in proc.stderr
