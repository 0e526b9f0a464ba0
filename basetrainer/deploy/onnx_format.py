"""ONNX: the export from PyTorch, its simplification, and its fp16 and int8 variants.

Both of torch's exporters are used: the dynamo exporter (``torch.export``; needs onnxscript;
ONNX opset 18 and later) and the TorchScript one (for an older ``opset``). The batch axis is
dynamic unless ``dynamic=False``. Simplification is onnxslim's (pure Python, maintained;
onnxsim gave the same graphs on the tested models). fp16 converts weights and activations
inside the graph and keeps fp32 inputs and outputs; int8 is ONNX Runtime's static
quantization (QDQ, per channel) calibrated on real images.

These functions write where they are told; :mod:`.files` makes the files land atomically.
"""
import logging
import os
import warnings
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from basetrainer.deploy.runtimes import require

logger = logging.getLogger(__name__)

DYNAMO_MIN_OPSET = 18
EXPORTERS = ("auto", "dynamo", "torchscript")


class ExportError(RuntimeError):
    """A converter could not convert the model; the message names the step and the fix."""


def pick_exporter(exporter: str, opset: Optional[int]) -> str:
    """``"dynamo"`` or ``"torchscript"`` for the requested exporter and opset."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter={exporter!r}; choose from {list(EXPORTERS)}")
    if opset is not None and (not isinstance(opset, int) or isinstance(opset, bool) or opset < 7):
        raise ValueError(f"opset_version={opset!r} must be an integer >= 7 (or None for the exporter's default)")
    if exporter == "auto":
        return "dynamo" if opset is None or opset >= DYNAMO_MIN_OPSET else "torchscript"
    if exporter == "dynamo" and opset is not None and opset < DYNAMO_MIN_OPSET:
        raise ValueError(f"torch's dynamo exporter writes opset {DYNAMO_MIN_OPSET} or later, not {opset}: "
                         f"use exporter='torchscript' for opset {opset}, or opset_version=None")
    return exporter


def write_onnx(model: nn.Module, path: str, input_shape: Sequence[int], input_names: Sequence[str] = ("input",),
               output_names: Sequence[str] = ("output",), dynamic: bool = True, opset: Optional[int] = None,
               exporter: str = "auto", simplify: bool = False) -> str:
    """Export ``model`` (eval mode, CPU) for inputs of ``input_shape`` (``(N, C, H, W)``, or ``N`` and
    any other sizes) to ``path``.

    Raises:
        ExportError: the exporter failed (the message says which and what to try).
        MissingRuntimeError: onnx (or onnxscript for the dynamo exporter) is not installed.
    """
    onnx = require("onnx")
    kind = pick_exporter(exporter, opset)
    if kind == "dynamo":
        require("onnxscript")
    n, *sizes = (int(v) for v in input_shape)
    # a batch of 2 in the example input: torch.export specialises a dimension of size 1
    example = torch.randn(2 if dynamic else n, *sizes)
    names, outs = list(input_names), list(output_names)
    kwargs: dict = dict(input_names=names, output_names=outs, verbose=False)
    if kind == "dynamo":
        if dynamic:
            kwargs["dynamic_shapes"] = ({0: torch.export.Dim("batch", min=1, max=65536)},)
        kwargs["opset_version"] = opset or DYNAMO_MIN_OPSET
    else:
        if dynamic:
            kwargs["dynamic_axes"] = {**{k: {0: "batch"} for k in names}, **{k: {0: "batch"} for k in outs}}
        kwargs["opset_version"] = opset or 17
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # the TorchScript exporter's notice
            warnings.simplefilter("ignore", FutureWarning)
            torch.onnx.export(model, (example,), path, dynamo=kind == "dynamo", **kwargs)
    except Exception as e:   # the exporters raise many types; one message names the way out
        # (a full disk shows as an OSError behind it; the staging folder around us tells it apart)
        other = "torchscript" if kind == "dynamo" else "dynamo"
        raise ExportError(f"torch's {kind} ONNX exporter failed on {type(model).__name__}: "
                          f"{type(e).__name__}: {_first_line(e)}. Try exporter='{other}', or another opset") from e
    proto = _load_inline(path)
    if simplify:
        proto = simplify_proto(proto)
    onnx.checker.check_model(proto)
    onnx.save(proto, path)
    return path


def simplify_proto(proto: Any) -> Any:
    """The graph simplified by onnxslim (constants folded, redundant nodes removed); the input
    shapes, dynamic batch included, are kept."""
    onnxslim = require("onnxslim")
    before = input_shapes(proto)
    try:
        slim = onnxslim.slim(proto)
    except Exception as e:
        raise ExportError(f"onnxslim could not simplify the graph ({type(e).__name__}: {_first_line(e)}); "
                          f"export without simplify") from e
    if input_shapes(slim) != before:
        raise ExportError(f"onnxslim changed the input shapes {before} -> {input_shapes(slim)}; export without "
                          f"simplify")
    logger.info("simplified the ONNX graph: %d -> %d nodes", len(proto.graph.node), len(slim.graph.node))
    return slim


def input_shapes(proto: Any) -> List[Tuple[str, List[Any]]]:
    """``[(name, [dim, ...])]`` of the graph's inputs (a dim is an int or a symbol name)."""
    found = []
    initializers = {i.name for i in proto.graph.initializer}
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                for d in value.type.tensor_type.shape.dim]
        found.append((value.name, dims))
    return found


def write_fp16(src: str, dst: str, op_block: Optional[Sequence[str]] = None,
               node_block: Optional[Sequence[str]] = None) -> str:
    """The fp32 ONNX model ``src`` with fp16 weights and arithmetic, fp32 inputs and outputs."""
    onnx = require("onnx")
    require("onnxruntime")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    proto = convert_float_to_float16(onnx.load(src), keep_io_types=True, op_block_list=list(op_block or []) or None,
                                     node_block_list=list(node_block or []) or None)
    onnx.save(proto, dst)
    return dst


def write_int8(src: str, dst: str, calibration: np.ndarray, batch: int = 16) -> str:
    """``src`` quantized to int8 by ONNX Runtime's static quantization (QDQ, per channel
    weights), with activation ranges calibrated on ``calibration`` ``(N, C, H, W)`` images; the
    first layer and the classifier stay fp32."""
    onnx = require("onnx")
    require("onnxruntime")
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    data = np.ascontiguousarray(calibration, dtype=np.float32)
    if data.ndim < 2 or len(data) == 0:
        raise ValueError(f"int8 calibration needs a batch of inputs ((N, C, H, W) images), got shape {data.shape}")
    proto = onnx.load(src)
    name = input_shapes(proto)[0][0]
    # the first layer (it reads the image) and the classifier (it writes the logits) stay fp32: the
    # usual mixed-precision PTQ recipe; quantizing them cost mobilenet_v2 on digits 9.4 points
    outputs = {o.name for o in proto.graph.output}
    ends = [n.name for n in proto.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")
            and (name in n.input or outputs.intersection(n.output))]
    last = [n for n in proto.graph.node if n.op_type in ("Gemm", "MatMul")][-1:]
    keep_fp32 = list(dict.fromkeys(ends + [n.name for n in last if n.name]))

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([data[i:i + batch] for i in range(0, len(data), batch)])

        def get_next(self) -> Optional[dict]:
            part = next(self.batches, None)
            return None if part is None else {name: part}

    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))   # ORT's quantizer warns on the root logger
    try:
        quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, nodes_to_exclude=keep_fp32)
    except Exception as e:
        raise ExportError(f"ONNX Runtime's int8 quantization failed ({type(e).__name__}: {_first_line(e)})") from e
    finally:
        root.setLevel(level)
    if not any(n.op_type == "QuantizeLinear" for n in onnx.load(dst).graph.node):
        raise ExportError(f"int8 quantized no layer of the model: the layers it keeps in fp32 (the first, "
                          f"{keep_fp32[:1]}, and the classifier, {keep_fp32[-1:]}) are all it has, so the file would "
                          f"be fp32: export it as onnx")
    return dst


def _load_inline(path: str) -> Any:
    """The ONNX file ``path`` with its weights inside: the dynamo exporter writes them to a data
    file beside it, read here and removed (the file is saved again with the weights inside, and
    the data file would take the weights' space a second time)."""
    onnx = require("onnx")
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    proto = onnx.load(path, load_external_data=False)
    folder = os.path.dirname(os.path.abspath(path))
    data = {entry.value for tensor in proto.graph.initializer if uses_external_data(tensor)
            for entry in tensor.external_data if entry.key == "location"}
    load_external_data_for_model(proto, folder)
    for name in data:
        file = os.path.abspath(os.path.join(folder, name))
        if os.path.dirname(file) == folder and os.path.isfile(file):
            os.remove(file)
    return proto


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
