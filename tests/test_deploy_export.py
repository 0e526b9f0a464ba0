"""Each export format against eager PyTorch on a small CNN (a few seconds each), the dynamic batch,
and the check catching an export that disagrees; plus conversions that fail half-way."""
import os
import stat
import sys

import numpy as np
import pytest
import torch
from torch import nn

from basetrainer.deploy import converters, onnx_format, runtimes
from basetrainer.deploy.export import ExportFailed, export_model
from basetrainer.deploy.parity import ParityError

SIZE = 16


class SmallNet(nn.Module):
    """conv-bn-relu x2, global pooling, linear: the layers the torchvision models are made of."""

    def __init__(self, num_classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def small_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = SmallNet()
    for m in model.modules():   # BatchNorm statistics of a trained model, not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    with torch.no_grad():       # logits of a trained classifier (tens), where fp16 shows in 1e-4
        model.fc.weight.mul_(30.0)
    return model.eval()


def images(n: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, SIZE, SIZE)).astype(np.float32)


def eager(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def engine_for(fmt: str, files):
    from basetrainer.engine.mnn_engine import MNNEngine
    from basetrainer.engine.ncnn_engine import NCNNEngine
    from basetrainer.engine.onnx_engine import ONNXEngine
    from basetrainer.engine.openvino_engine import OpenVINOEngine

    if fmt.startswith("onnx"):
        return ONNXEngine(files[0], use_gpu=False, quant={"onnx": 0, "onnx-fp16": 1, "onnx-int8": 2}[fmt])
    if fmt == "mnn":
        return MNNEngine(files[0])
    if fmt.startswith("ncnn"):
        return NCNNEngine(files[0], files[1], quant=int(fmt == "ncnn-fp16"))
    return OpenVINOEngine(files[0])


# (format, files written, bound on max |Δ| from eager of an independent run of the file)
FORMATS = [("onnx", ["m.onnx"], 1e-4), ("onnx-fp16", ["m_fp16.onnx"], 2e-2), ("onnx-int8", ["m_int8.onnx"], None),
           ("mnn", ["m.mnn"], 1e-4), ("ncnn", ["m.ncnn.param", "m.ncnn.bin"], 1e-4),
           ("ncnn-fp16", ["m_fp16.ncnn.param", "m_fp16.ncnn.bin"], 2e-2), ("openvino", ["m.xml", "m.bin"], 1e-4)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,names,bound", FORMATS, ids=[f[0] for f in FORMATS])
def test_format_agrees_with_eager(tmp_path, fmt, names, bound):
    model, x = small_net(), images()
    report = export_model(model, fmt, out_dir=str(tmp_path), input_size=[SIZE, SIZE], check=x, calibration=x,
                          runs=0, batch=37, name="m")
    row = report.rows[1]
    assert (row.format, row.status, row.problems) == (fmt, "ok", [])
    assert [os.path.basename(f) for f in row.files] == names
    assert sorted(os.listdir(tmp_path)) == sorted(names + ["m.export.json", "m.export.md"])  # no staging left
    assert row.parity["samples"] == 40 and row.parity["batch_max_abs"] <= (bound or 1e-3)
    # an independent run of the written file, against eager PyTorch
    out = engine_for(fmt, [str(tmp_path / n) for n in names])(x)[0]
    ref = eager(model, x)
    agreement = float(np.mean(out.argmax(1) == ref.argmax(1)))
    if bound is None:   # int8: quantized, so the figures differ; the middle conv is int8, the ends fp32
        import onnx

        assert agreement >= 0.9 and 0 < np.abs(out - ref).max() < 0.1 * np.abs(ref).max()
        graph = onnx.load(str(tmp_path / names[0])).graph
        made_by = {o: n for n in graph.node for o in n.output}
        convs = [n for n in graph.node if n.op_type in ("Conv", "Gemm")]
        from_int8 = [made_by.get(n.input[1]) is not None and made_by[n.input[1]].op_type == "DequantizeLinear"
                     for n in convs]
        assert from_int8 == [False, True, False]                # first conv, second conv, classifier
    else:
        assert np.abs(out - ref).max() <= (bound if bound < 1e-3 else bound * float(np.abs(ref).max()))
        assert agreement == 1.0
    assert row.parity["max_abs"] == pytest.approx(float(np.abs(out - ref).max()), rel=0.5, abs=1e-6)


@pytest.mark.slow
def test_dynamic_batch_gives_the_same_per_sample_results(tmp_path):
    from basetrainer.engine.onnx_engine import ONNXEngine

    model, x = small_net(), images(37)
    export_model(model, "onnx", out_dir=str(tmp_path), input_size=[SIZE, SIZE], check=x, runs=0, name="m")
    engine = ONNXEngine(str(tmp_path / "m.onnx"), use_gpu=False)
    assert engine.dynamic and engine.input_shape == (3, SIZE, SIZE)
    together = engine(x)[0]
    alone = np.concatenate([engine(x[i:i + 1])[0] for i in range(37)])
    assert together.shape == (37, 5)
    assert np.abs(together - alone).max() <= 1e-6
    assert np.abs(together - eager(model, x)).max() <= 1e-4


def test_fixed_batch_export_runs_sample_by_sample(tmp_path):
    from basetrainer.utils.converter.pytorch2onnx import convert2onnx
    from basetrainer.engine.onnx_engine import ONNXEngine

    model, x = small_net(), images(6)
    path = convert2onnx(model, (1, 3, SIZE, SIZE), onnx_file=str(tmp_path / "fixed.onnx"), dynamic=False)
    engine = ONNXEngine(path, use_gpu=False)
    assert not engine.dynamic                                  # batch of 1 in the file: fed in turn
    assert np.abs(engine(x)[0] - eager(model, x)).max() <= 1e-4


class Heads(nn.Module):
    """SmallNet's features with several heads of other widths and scales: named against their
    alphabetical order (``logits``, ``boxes``, ``angle``), as a detector's outputs are."""

    def __init__(self, widths=(2, 5, 3), scales=(30.0, 1.0, 0.01)) -> None:
        super().__init__()
        self.features = small_net().features
        self.heads = nn.ModuleList(nn.Linear(16, w) for w in widths)
        self.scales = scales

    def forward(self, x: torch.Tensor):
        f = self.features(x)
        return tuple(head(f) * s for head, s in zip(self.heads, self.scales))


@pytest.mark.slow
@pytest.mark.parametrize("heads", [2, 3])
@pytest.mark.parametrize("fmt", ["onnx", "mnn", "ncnn", "openvino"])
def test_outputs_come_back_in_the_models_order(tmp_path, fmt, heads):
    """Every engine returns the outputs in the order the model returns them (MNN returned them
    sorted by name, and a two-output model failed its check on the shapes)."""
    names = ("logits", "boxes", "angle")[:heads]
    model, x = Heads(scales=(30.0, 1.0, 0.01)[:heads]).eval(), images(12)
    report = export_model(model, fmt, out_dir=str(tmp_path), input_size=[SIZE, SIZE], check=x, runs=0, batch=5,
                          name="m", output_names=names)
    row = report.rows[1]
    assert (row.status, row.problems) == ("ok", [])
    names_written = [os.path.basename(f) for f in row.files]
    engine = engine_for(fmt, [str(tmp_path / n) for n in names_written])
    if fmt != "ncnn":                            # pnnx names its outputs out0, out1, ...
        assert list(engine.out_names) == list(names)
    outs = engine(x)
    with torch.no_grad():
        refs = [r.numpy() for r in model(torch.from_numpy(x))]
    assert [o.shape for o in outs] == [r.shape for r in refs] == [(12, w) for w in (2, 5, 3)[:heads]]
    for out, ref in zip(outs, refs):
        assert np.abs(out - ref).max() <= 1e-5 * np.sqrt(np.mean(ref.astype(np.float64) ** 2))


@pytest.mark.slow
def test_command_line_mnn_on_a_two_output_model(tmp_path, monkeypatch, capsys):
    """python -m basetrainer.deploy --format mnn on a model with two outputs (it exited 1: "output 0
    has shape (16, 2) in the export and (16, 5) in the model")."""
    from basetrainer.deploy import export as export_mod
    from basetrainer.deploy.__main__ import main as cli
    from basetrainer.deploy.source import ModelSource

    model = Heads(scales=(30.0, 1.0)).eval()
    monkeypatch.setattr(export_mod, "load_model", lambda *a, **k: ModelSource(model, "two heads", None, None,
                                                                              [SIZE, SIZE]))
    assert cli(["heads.pth", "--format", "mnn", "--out-dir", str(tmp_path), "--runs", "0"]) == 0
    assert "| mnn | MNN | fp32 | heads.mnn |" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["heads.export.json", "heads.export.md", "heads.mnn"]


def _perturbed(model: nn.Module) -> nn.Module:
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.fc.weight.mul_(1.001)                           # 0.1 % on one layer
    return other


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx", "mnn", "openvino", "ncnn"])
def test_a_disagreeing_export_is_an_error_and_not_written(tmp_path, monkeypatch, fmt):
    """The check catches an export of other weights (as a wrong converter would write)."""
    if fmt == "ncnn":
        real = converters.write_ncnn
        monkeypatch.setattr(converters, "write_ncnn", lambda m, *a, **k: real(_perturbed(m), *a, **k))
    else:
        real = onnx_format.write_onnx
        monkeypatch.setattr(onnx_format, "write_onnx", lambda m, *a, **k: real(_perturbed(m), *a, **k))
    (tmp_path / "m.onnx").write_bytes(b"an older export")      # left as it was
    with pytest.raises(ParityError, match=rf"{fmt}: outside its bound: max \|Δ\| .* > 0.0001 x scale"):
        export_model(small_net(), fmt, out_dir=str(tmp_path), input_size=[SIZE, SIZE], check=images(), runs=0,
                     name="m")
    assert sorted(os.listdir(tmp_path)) == ["m.export.json", "m.export.md", "m.onnx"]
    assert (tmp_path / "m.onnx").read_bytes() == b"an older export"
    assert "FAIL" in (tmp_path / "m.export.md").read_text()


def _fake_tool(tmp_path, body: str) -> str:
    path = tmp_path / "tool.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.distributed
def test_conversion_failing_half_way_leaves_no_file(tmp_path, monkeypatch):
    """pnnx writes part of the .param, then crashes: an error with its output, nothing at the final
    paths, no staging folder; the other formats of the run are still written."""
    tool = _fake_tool(tmp_path, 'for a in "$@"; do case "$a" in ncnnparam=*) echo 7767517 > "${a#ncnnparam=}";; '
                                'esac; done\necho "Segmentation fault in pass_ncnn" >&2\nexit 139\n')
    monkeypatch.setattr(runtimes, "pnnx_binary", lambda: tool)
    monkeypatch.setattr(converters, "pnnx_binary", lambda: tool)
    out = tmp_path / "out"
    with pytest.raises(ExportFailed, match=r"ncnn: not exported: ExportError: pnnx failed \(exit code 139\): "
                                           r"Segmentation fault in pass_ncnn"):
        export_model(small_net(), "onnx,ncnn", out_dir=str(out), input_size=[SIZE, SIZE], check=images(8),
                     runs=0, name="m")
    assert sorted(os.listdir(out)) == ["m.export.json", "m.export.md", "m.onnx"]


@pytest.mark.distributed
def test_converter_claiming_success_with_a_damaged_file(tmp_path, monkeypatch):
    """MNN's converter says "Converted Success!" but wrote garbage: refused, nothing written."""
    fake = [sys.executable, "-c", "import sys; a = sys.argv; open(a[a.index('--MNNModel') + 1], 'wb')"
                                  ".write(b'garbage'); print('Converted Success!')"]
    monkeypatch.setattr(converters, "mnn_converter", lambda: fake)
    out = tmp_path / "out"
    with pytest.raises(ExportFailed, match="mnn: not exported"):
        export_model(small_net(), "mnn", out_dir=str(out), input_size=[SIZE, SIZE], check=images(8), runs=0,
                     name="m")
    assert sorted(os.listdir(out)) == ["m.export.json", "m.export.md"]


def test_input_size_the_model_cannot_take(tmp_path):
    class Fixed(nn.Module):   # a flatten into a fixed Linear: only 16x16 fits
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * SIZE * SIZE, 3)

        def forward(self, x):
            return self.fc(self.conv(x).flatten(1))

    with pytest.raises(ValueError, match=r"cannot take inputs of 32x32 \(W x H\).*--input-size W H"):
        export_model(Fixed(), "onnx", out_dir=str(tmp_path / "out"), input_size=[32, 32], runs=0)
    with pytest.raises(ValueError, match=r"input_size=\[0, 16\] must be two positive integers"):
        export_model(Fixed(), "onnx", out_dir=str(tmp_path / "out"), input_size=[0, 16], runs=0)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_leaves_the_users_model_alone(tmp_path):
    model = small_net().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_model(model, "onnx", out_dir=str(tmp_path), input_size=[SIZE, SIZE], runs=0)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_latency_rows_interleaved_with_eager(tmp_path):
    report = export_model(small_net(), "onnx,openvino", out_dir=str(tmp_path), input_size=[SIZE, SIZE],
                          check=images(8), runs=3, warmup=1, batch=4, threads=1, name="m")
    assert [r.format for r in report.rows] == ["pytorch", "onnx", "openvino"]
    for row in report.rows:
        assert sorted(row.latency) == ["batch 1", "batch 4"]
        assert row.latency["batch 4"]["runs"] == 3 and row.latency["batch 4"]["batch"] == 4
        assert row.latency["batch 1"]["q1_ms"] <= row.latency["batch 1"]["median_ms"] <= row.latency["batch 1"]["q3_ms"]
    table = (tmp_path / "m.export.md").read_text()
    assert "| pytorch | PyTorch (eager) |" in table and "| batch 4, ms per image (IQR) | vs eager |" in table
    assert "Latency on the CPU, 1 thread: median of 3 timed runs after 1 warm-up rounds" in table


@pytest.mark.slow
def test_exporter_choice_and_engine_quantization_on_load(tmp_path):
    from basetrainer.deploy.onnx_format import pick_exporter
    from basetrainer.engine.onnx_engine import ONNXEngine

    assert [pick_exporter("auto", o) for o in (None, 11, 17, 18)] == ["dynamo", "torchscript", "torchscript", "dynamo"]
    with pytest.raises(ValueError, match="writes opset 18 or later, not 11: use exporter='torchscript'"):
        pick_exporter("dynamo", 11)
    model, x = small_net(), images(24)
    export_model(model, "onnx", out_dir=str(tmp_path), input_size=[SIZE, SIZE], check=x, runs=0, name="m")
    path, ref = str(tmp_path / "m.onnx"), eager(model, x)
    with pytest.raises(ValueError, match=r"quant=2\) quantizes the model to int8 and needs calibration images"):
        ONNXEngine(path, use_gpu=False, quant=2)
    int8 = ONNXEngine(path, use_gpu=False, quant=2, calibration=x)          # quantized in memory
    half = ONNXEngine(path, use_gpu=False, quant=1, simplify=True)
    # fp32 arithmetic stays within 1e-5 of eager here; fp16 and int8 move the logits more
    assert 1e-3 < np.abs(int8(x)[0] - ref).max() < 0.1 * np.abs(ref).max()
    assert 1e-5 < np.abs(half(x)[0] - ref).max() <= 1e-2 * np.abs(ref).max()
    assert sorted(os.listdir(tmp_path)) == ["m.export.json", "m.export.md", "m.onnx"]   # nothing written beside
