"""The original's deploy half (DESIGN.md §1b): import paths and keywords, a quiet import, the
hardware engines' errors, a missing runtime, and the figures of the parity and latency helpers."""
import importlib
import inspect
import logging
import os
import subprocess
import sys

import numpy as np
import torch
import pytest

from conftest import ROOT

RUNTIMES = ("onnx", "onnxruntime", "onnxscript", "onnxslim", "MNN", "_tools", "ncnn", "pnnx", "openvino",
            "openvino_telemetry", "tensorrt")

# (module, name, the original's keywords in their positional order)
SIGNATURES = [
    ("basetrainer.utils.converter.pytorch2onnx", "convert2onnx",
     ["model", "input_shape", "input_names", "output_names", "onnx_file", "dynamic", "simplify", "opset_version",
      "use_prune", "sparsity", "device"]),
    ("basetrainer.utils.converter.onnx2mnn", "convert2mnn", ["onnx_file", "shape1", "shape2", "out_file", "fp16"]),
    ("basetrainer.utils.converter.onnx2ncnn", "convert2ncnn",
     ["onnx_file", "shape1", "shape2", "out_file", "fp16", "use_prune", "sparsity", "device"]),
    ("basetrainer.utils.converter.pytorch2ncnn", "convert2ncnn",
     ["model", "input_shape", "input_names", "output_names", "out_file", "fp16", "use_prune", "sparsity", "device"]),
    ("basetrainer.utils.converter.onnx2trt", "onnx2trt",
     ["onnx_file", "trt_file", "input_shape", "max_batch_size", "fp16"]),
    ("basetrainer.engine.onnx_engine", "ONNXEngine",
     ["model_file", "use_gpu", "quant", "simplify", "dynamic", "device_id"]),
    ("basetrainer.engine.onnx_engine", "simplify_onnx", ["onnx_file", "onnx_model", "dynamic"]),
    ("basetrainer.engine.onnx_engine", "onnx_fp16", ["onnx_file", "onnx_model", "out_file", "op_block", "nd_block"]),
    ("basetrainer.engine.mnn_engine", "MNNEngine",
     ["model_file", "quant", "simplify", "dynamic", "num_thread", "device"]),
    ("basetrainer.engine.ncnn_engine", "NCNNEngine", ["par_file", "bin_file", "num_thread", "use_gpu", "use_fp16"]),
    ("basetrainer.engine.openvino_engine", "OpenVINOEngine",
     ["model_file", "use_gpu", "quant", "simplify", "dynamic", "device_id"]),
    ("basetrainer.engine.trt_engine", "TRTEngine", ["model_file", "input_shape", "quant", "calibrator"]),
    ("basetrainer.engine.trt_engine", "onnx2trt", ["onnx_file", "trt_file", "input_shape", "max_batch_size", "fp16"]),
    ("basetrainer.engine.rknn_engine", "RKNNEngine",
     ["model_file", "shape", "device", "quant", "simplify", "dynamic", "dynamic_shape"]),
]


@pytest.mark.parametrize("module,name,keywords", SIGNATURES, ids=[f"{m.rsplit('.', 1)[1]}.{n}" for m, n, _ in SIGNATURES])
def test_original_paths_and_keywords(module, name, keywords):
    obj = getattr(importlib.import_module(module), name)
    params = [p for p in inspect.signature(obj).parameters if p != "self"]
    assert params[:len(keywords)] == keywords


def test_every_engine_takes_the_common_keywords():
    """quant (0 fp32), use_gpu, simplify, dynamic, device_id on every engine (the issue's list)."""
    from basetrainer.engine import mnn_engine, ncnn_engine, onnx_engine, openvino_engine, rknn_engine, trt_engine

    for cls in (onnx_engine.ONNXEngine, mnn_engine.MNNEngine, ncnn_engine.NCNNEngine, openvino_engine.OpenVINOEngine):
        params = inspect.signature(cls).parameters
        missing = [k for k in ("use_gpu", "quant", "simplify", "dynamic", "device_id") if k not in params]
        assert missing == [], (cls.__name__, missing)
        assert params["quant"].default == 0, cls.__name__          # fp32 unless asked
    for cls in (trt_engine.TRTEngine, rknn_engine.RKNNEngine):
        assert "quant" in inspect.signature(cls).parameters


@pytest.mark.distributed
def test_entry_points_import_no_runtime():
    code = ("import sys\n"
            "import basetrainer.engine.onnx_engine, basetrainer.engine.mnn_engine, basetrainer.engine.ncnn_engine\n"
            "import basetrainer.engine.openvino_engine, basetrainer.engine.trt_engine, basetrainer.engine.rknn_engine\n"
            "from basetrainer.utils.converter import pytorch2onnx, onnx2mnn, onnx2ncnn, pytorch2ncnn, onnx2trt\n"
            "import basetrainer.deploy.export, basetrainer.deploy.__main__\n"
            f"print(sorted(m for m in {RUNTIMES!r} if m in sys.modules), end='')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "[]", "")


def test_hardware_engines_name_package_and_hardware():
    """No tensorrt and no Rockchip runtime here: one error naming the package and the hardware."""
    from basetrainer.deploy.runtimes import MissingRuntimeError
    from basetrainer.engine.rknn_engine import RKNNEngine
    from basetrainer.engine.trt_engine import TRTEngine, onnx2trt

    if importlib.util.find_spec("tensorrt") is None:
        for build in (lambda: TRTEngine("model.onnx", (1, 3, 32, 32)), lambda: onnx2trt("model.onnx")):
            with pytest.raises(MissingRuntimeError, match=r"tensorrt.*pip install tensorrt"):
                build()
    with pytest.raises(MissingRuntimeError, match=r"Rockchip NPU.*pip install rknn-toolkit-lite2.*rknn-toolkit2"):
        RKNNEngine("model.onnx")


def test_missing_runtime_names_the_pip_command(monkeypatch, tmp_path):
    """A runtime that cannot be imported (simulated): the engine and the export both name the extra."""
    from basetrainer.deploy.export import export_model
    from basetrainer.deploy.runtimes import MissingRuntimeError
    from basetrainer.engine.mnn_engine import MNNEngine

    monkeypatch.setitem(sys.modules, "MNN", None)          # import MNN raises ImportError
    with pytest.raises(MissingRuntimeError, match=r'MNN.*pip install "basetrainer\[mnn\]" \(or pip install mnn\)'):
        MNNEngine(str(tmp_path / "model.mnn"))
    monkeypatch.setitem(sys.modules, "ncnn", None)
    with pytest.raises(MissingRuntimeError, match=r'mnn: MNN \| ncnn: ncnn; install them: pip install "basetrainer\[mnn,ncnn\]"'):
        export_model(str(tmp_path / "never-read.pth"), "onnx,mnn,ncnn", out_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()                  # refused before anything was written


def test_unknown_format_lists_the_valid_ones(tmp_path):
    from basetrainer.deploy.export import export_model

    with pytest.raises(ValueError, match=r"unknown format 'tflite'; choose from \[.*'ncnn'.*'onnx'.*'openvino'"):
        export_model(str(tmp_path / "never-read.pth"), "onnx,tflite", out_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_latency_median_and_spread():
    from basetrainer.deploy.latency import interleaved, summarize

    lat = summarize([4.0, 1.0, 3.0, 2.0, 100.0], batch=2)
    assert (lat.median_ms, lat.q1_ms, lat.q3_ms, lat.min_ms, lat.max_ms, lat.runs) == (3.0, 2.0, 4.0, 1.0, 100.0, 5)
    assert lat.spread_ms == 2.0 and lat.per_sample_ms == 1.5
    calls = []
    result = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, runs=3, warmup=1)
    assert calls == ["a", "b"] * 4                            # one of each per round, warm-up included
    assert result["a"].runs == 3 and result["b"].runs == 3
    with pytest.raises(ValueError, match="runs=0 must be an integer >= 1"):
        interleaved({"a": lambda: None}, runs=0)
    with pytest.raises(ValueError, match="no timed runs"):
        summarize([])


def test_parity_figures_and_bounds():
    from basetrainer.deploy.parity import BOUNDS, compare, failures

    ref = np.array([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0], [0.0, 0.5, 0.4], [2.0, 2.5, 0.0]])   # scale: std 1.03
    out = ref.copy()
    out[2] = [0.0, 0.44, 0.45]                                # flips sample 2's top-1, moves it by 0.06
    p = compare([ref], [out], labels=np.array([1, 0, 1, 1]), classes=[0])
    assert (p.samples, p.agreement, p.accuracy_reference, p.accuracy) == (4, 0.75, 1.0, 0.75)
    assert p.max_abs == pytest.approx(0.06) and p.outputs[0].scale == pytest.approx(ref.std())
    assert failures(p, BOUNDS["fp32"]) == ["max |Δ| 0.06 > 0.0001 x scale 1.03 (relative 0.058)",
                                           "top-1 agreement 75.00% < 100.0%"]
    assert failures(p, BOUNDS["int8"]) == ["accuracy 75.00% is 25.00 points below eager 100.00% (bound 1)"]
    assert failures(compare([ref], [ref + 1e-5], classes=[0]), BOUNDS["fp32"]) == []          # 1e-5 <= 1e-4 x 1.03
    assert failures(compare([ref], [ref + 0.05], classes=[0]), BOUNDS["fp16"]) == []          # 0.05 <= 5e-2 x 1.03
    assert failures(compare([ref], [ref + 0.06]), BOUNDS["fp16"])[0].startswith("max |Δ| 0.06 > 0.05 x scale")
    nan = ref.copy()
    nan[0, 0] = np.nan
    assert failures(compare([ref], [nan]), BOUNDS["fp32"]) == [
        "NaN or infinity in the export where the model's value is another"]


def test_engine_inputs_are_checked_and_nothing_is_printed(tmp_path, capfd, caplog):
    """An engine takes numpy or torch (N, C, H, W); performance() logs and returns the latency."""
    import torch
    from basetrainer.deploy.engines.base import InferenceEngine

    class Doubler(InferenceEngine):
        name = "doubler"

        def _run(self, batch):
            return [batch.sum(axis=(1, 2, 3))[:, None] * 2]

    engine = Doubler()
    engine.input_shape = (3, 4, 4)
    x = np.ones((5, 3, 4, 4), dtype=np.float64)
    np.testing.assert_array_equal(engine(x)[0], np.full((5, 1), 96.0))
    np.testing.assert_array_equal(engine(torch.ones(2, 3, 4, 4))[0], np.full((2, 1), 96.0))
    for bad, message in ((np.ones((3, 4, 4)), r"\(3, 4, 4\): expected \(N, C, H, W\).*x\[None\]"),
                         (np.ones((1, 3, 8, 8)), r"\(1, 3, 8, 8\) do not fit the model, which takes \(N, 3, 4, 4\)"),
                         ([1, 2], "numpy array or a torch tensor")):
        with pytest.raises((ValueError, TypeError), match=message):
            engine(bad)
    with caplog.at_level(logging.INFO, logger="basetrainer.deploy.engines.base"):
        latency = engine.performance(x, iterate=7, warmup=1)
    assert latency.runs == 7 and latency.batch == 5 and latency.median_ms >= 0 and latency.q3_ms >= latency.q1_ms
    assert any("doubler latency" in r.getMessage() for r in caplog.records)
    assert capfd.readouterr().out == ""


def test_quant_out_of_range_is_refused(tmp_path):
    from basetrainer.deploy.engines.base import check_quant

    assert check_quant(1, "X") == 1
    with pytest.raises(ValueError, match=r"quant=3; choose 0 \(fp32\), 1 \(fp16\) or 2 \(int8\)"):
        check_quant(3, "X")
    with pytest.raises(ValueError, match=r"MNNEngine has no int8 mode.*ONNXEngine\(quant=2\)"):
        check_quant(2, "MNNEngine", supported=(0, 1))


def test_onnx_without_simplify_needs_no_onnxslim(monkeypatch, tmp_path):
    """onnxslim only simplifies: a machine without it (the GPU machine's Python) exports ONNX with
    simplify=False, and with simplify=True the error names onnxslim and its pip command."""
    from basetrainer.deploy.export import export_model
    from basetrainer.deploy.runtimes import MissingRuntimeError

    monkeypatch.setitem(sys.modules, "onnxslim", None)     # import onnxslim raises ImportError
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)).eval()
    check = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    with pytest.raises(MissingRuntimeError, match=r"onnx: onnxslim; install them: pip install"):
        export_model(model, "onnx", out_dir=str(tmp_path / "slim"), check=check, input_size=[8, 8], runs=0)
    assert not (tmp_path / "slim").exists()
    report = export_model(model, "onnx", out_dir=str(tmp_path / "plain"), check=check, input_size=[8, 8], runs=0,
                           simplify=False)
    rows = {r.format: r for r in report.rows}
    assert rows["onnx"].status == "ok" and rows["onnx"].parity["rel"] < 1e-4
