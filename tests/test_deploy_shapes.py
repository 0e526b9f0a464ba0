"""Export of a model whose input is not an image: ``input_shape=`` (or a check array that is not
``(N, C, H, W)``) gives the shape of one input, and every format that runs here takes it."""
import numpy as np
import pytest
import torch
from torch import nn

from basetrainer.deploy.export import export_model
from basetrainer.deploy.onnx_format import ExportError

FORMATS = "onnx,onnx-fp16,mnn,ncnn,openvino"


class TwoHeads(nn.Module):
    """Class scores and a regression value from 16 features."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.cls, self.reg = nn.Linear(16, 24), nn.Linear(24, 4), nn.Linear(24, 1)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.cls(h), self.reg(h)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 4)).eval()


def _inputs(n: int = 40, *shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, *(shape or (16,)))).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["array", "input_shape"])
def test_an_mlp_exports_to_every_format_from_the_shape_of_its_input(tmp_path, how):
    kw = {"check": _inputs()} if how == "array" else {"input_shape": [16]}
    report = export_model(_mlp(), FORMATS, out_dir=str(tmp_path), runs=0, report_files=False, **kw)
    assert report.input_shape == [1, 16]
    rows = {r.format: r for r in report.rows}
    for name in FORMATS.split(","):
        assert rows[name].status == "ok", (name, rows[name].problems)
        assert rows[name].parity["rel"] < (5e-2 if "16" in name else 1e-4), name


@pytest.mark.slow
def test_a_two_output_model_of_features_exports_with_its_outputs_in_order(tmp_path):
    torch.manual_seed(0)
    model = TwoHeads().eval()
    report = export_model(model, "onnx,mnn,openvino", out_dir=str(tmp_path), check=_inputs(), runs=0,
                          report_files=False, output_names=("logits", "value"))
    for row in report.rows[1:]:
        assert row.status == "ok", (row.format, row.problems)
        assert [o["name"] for o in row.parity["outputs"]] == ["logits", "value"]
        assert [tuple(o["shape"]) for o in row.parity["outputs"]] == [(40, 4), (40, 1)]


def test_input_shape_beside_an_image_size_or_a_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"input_shape=\[16\].*input_size=\[8, 8\].*one or the other"):
        export_model(_mlp(), "onnx", out_dir=str(tmp_path), input_shape=[16], input_size=[8, 8])
    with pytest.raises(ValueError, match=r"input_shape=\[16, 0\] must be the positive sizes"):
        export_model(_mlp(), "onnx", out_dir=str(tmp_path), input_shape=[16, 0])
    with pytest.raises(ValueError, match=r"folder of images.*\(16,\).*array \(N, 16\)"):
        export_model(_mlp(), "onnx", out_dir=str(tmp_path), input_shape=[16], check=str(tmp_path))
    with pytest.raises(ValueError, match=r"cannot take inputs of shape \(12,\).*mat1 and mat2"):
        export_model(_mlp(), "onnx", out_dir=str(tmp_path), input_shape=[12])


@pytest.mark.slow
def test_int8_that_quantizes_no_layer_is_an_error_not_an_fp32_file(tmp_path):
    # int8 keeps the first layer and the classifier in fp32: a two-layer model has nothing else
    two = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    with pytest.raises(ExportError) as e:
        export_model(two, "onnx-int8", out_dir=str(tmp_path), check=_inputs(), calibration=_inputs(), runs=0,
                     report_files=False)
    row = e.value.report.rows[1]
    assert row.status == "error" and "int8 quantized no layer" in row.problems[0] and "export it as onnx" in row.problems[0]
    assert not list(tmp_path.glob("*.onnx"))
    report = export_model(_mlp(), "onnx-int8", out_dir=str(tmp_path), check=_inputs(), calibration=_inputs(),
                          runs=0, report_files=False)   # the middle layer is quantized
    assert report.rows[1].status == "ok" and (tmp_path / "model_int8.onnx").is_file()
