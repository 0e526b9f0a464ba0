"""The issue's models through every format that runs here: resnet18, mobilenet_v2 and a resnet18
pruned by torch-pruning, at 32x32 (the digits example's size), each export checked against eager
PyTorch and its written file run again independently. Slow: three real models, seven formats."""
import os

import numpy as np
import pytest
import torch

from basetrainer.deploy.export import export_model
from basetrainer.models.build_models import get_models

FORMATS = "onnx,onnx-fp16,mnn,ncnn,ncnn-fp16,openvino"


def _model(name: str, tmp_path):
    torch.manual_seed(0)
    if name == "resnet18-pruned":
        from basetrainer.pruning.nni_pruning import model_pruning

        return model_pruning(get_models("resnet18", [32, 32], 10), [32, 32], sparsity=0.5,
                             output_prune=str(tmp_path / "prune")).eval()
    return get_models(name, [32, 32], 10).eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "resnet18-pruned"])
def test_model_through_every_format(tmp_path, name):
    from basetrainer.engine.mnn_engine import MNNEngine
    from basetrainer.engine.ncnn_engine import NCNNEngine
    from basetrainer.engine.onnx_engine import ONNXEngine
    from basetrainer.engine.openvino_engine import OpenVINOEngine

    model = _model(name, tmp_path)
    x = np.random.default_rng(0).standard_normal((24, 3, 32, 32)).astype(np.float32)
    report = export_model(model, FORMATS, out_dir=str(tmp_path / "out"), input_size=[32, 32], check=x, runs=0,
                          batch=12, name="m")
    assert [(r.format, r.status) for r in report.rows[1:]] == [(f, "ok") for f in FORMATS.split(",")]
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    out = str(tmp_path / "out")
    runs = {"onnx": ONNXEngine(os.path.join(out, "m.onnx"), use_gpu=False),
            "mnn": MNNEngine(os.path.join(out, "m.mnn")),
            "ncnn": NCNNEngine(os.path.join(out, "m.ncnn.param")),
            "openvino": OpenVINOEngine(os.path.join(out, "m.xml")),
            "onnx-fp16": ONNXEngine(os.path.join(out, "m_fp16.onnx"), use_gpu=False, quant=1),
            "ncnn-fp16": NCNNEngine(os.path.join(out, "m_fp16.ncnn.param"), quant=1)}
    for fmt, engine in runs.items():
        got = engine(x)[0]
        worst = float(np.abs(got - ref).max())
        if fmt.endswith("fp16"):
            assert worst <= 1e-2 * np.abs(ref).max() and np.mean(got.argmax(1) == ref.argmax(1)) >= 0.95, fmt
        else:
            assert worst <= 1e-4 and np.array_equal(got.argmax(1), ref.argmax(1)), (fmt, worst)
    if name == "resnet18-pruned":
        dense = sum(p.numel() for p in get_models("resnet18", [32, 32], 10).parameters())
        assert os.path.getsize(os.path.join(out, "m.onnx")) < 0.4 * dense * 4     # the smaller shapes exported
