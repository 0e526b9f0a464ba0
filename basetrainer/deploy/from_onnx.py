"""Conversions of an ONNX file that already exists (the original's ``simplify_onnx``,
``onnx_fp16``, ``onnx2mnn`` and ``onnx2ncnn``), each checked before it is called done.

There is no PyTorch model here, so the reference is the fp32 ONNX file run by ONNX Runtime, on
random inputs of the model's input shape; the result must be within its precision's bound
(:data:`basetrainer.deploy.parity.BOUNDS`), or no file is written. Every file lands atomically.
"""
import logging
import os
from typing import Any, List, Optional, Sequence

import numpy as np

from basetrainer.deploy import converters, onnx_format
from basetrainer.deploy.engines.base import InferenceEngine
from basetrainer.deploy.files import staging
from basetrainer.deploy.parity import BOUNDS, ParityError, compare, failures
from basetrainer.deploy.runtimes import require

logger = logging.getLogger(__name__)


def _shape(onnx_file: str, shape: Optional[Sequence[int]]) -> List[int]:
    if shape:
        dims = [int(d) for d in shape]
        if len(dims) != 4 or min(dims) < 1:
            raise ValueError(f"input shape {list(shape)!r} must be (N, C, H, W) of positive integers")
        return dims
    onnx = require("onnx")
    dims = onnx_format.input_shapes(onnx.load(onnx_file))[0][1]
    if len(dims) != 4 or not all(isinstance(d, int) and d > 0 for d in dims[1:]):
        raise ValueError(f"{onnx_file!r} has input dims {dims}; give the input shape (N, C, H, W), e.g. "
                         f"shape1=[1, 3, 224, 224]")
    return [1] + list(dims[1:])


def check_against_onnx(onnx_file: str, engine: InferenceEngine, precision: str,
                       shape: Optional[Sequence[int]] = None, samples: int = 8) -> None:
    """Raise :class:`ParityError` when ``engine`` is outside ``precision``'s bound from ONNX
    Runtime running the fp32 ``onnx_file`` on ``samples`` random inputs."""
    from basetrainer.deploy.engines.onnx_runtime import ONNXEngine

    dims = _shape(onnx_file, shape)
    inputs = np.random.default_rng(0).standard_normal((samples, *dims[1:])).astype(np.float32)
    reference = ONNXEngine(onnx_file, use_gpu=False, quant=0)
    if not reference.dynamic:
        inputs = inputs[:1]
    parity = compare(reference(inputs), engine(inputs))
    problems = failures(parity, BOUNDS[precision])
    if problems:
        raise ParityError(f"the converted model disagrees with {onnx_file!r} beyond the {precision} bound: "
                          f"{'; '.join(problems)}; no file was written")
    logger.info("checked against %s on %d random inputs: max |Δ| %.3g", onnx_file, len(inputs), parity.max_abs)


def _require_file(onnx_file: str) -> None:
    if not onnx_file or not os.path.isfile(onnx_file):
        raise FileNotFoundError(f"ONNX file {onnx_file!r} does not exist; export the model first "
                                f"(basetrainer.utils.converter.pytorch2onnx.convert2onnx)")


def simplify_onnx(onnx_file: str, onnx_model: Any = None, dynamic: bool = False, out_file: str = "") -> str:
    """Write the onnxslim-simplified graph to ``out_file`` (default ``<name>_sim.onnx``); return it.

    ``dynamic`` is accepted for the original's signature (input shapes, a dynamic batch
    included, are always kept).
    """
    onnx = require("onnx")
    if onnx_model is None:
        _require_file(onnx_file)
    out_file = out_file or os.path.splitext(onnx_file)[0] + "_sim.onnx"
    proto = onnx_format.simplify_proto(onnx_model if onnx_model is not None else onnx.load(onnx_file))
    return _write_checked(onnx_file, proto, out_file, "fp32")


def onnx_fp16(onnx_file: str, onnx_model: Any = None, out_file: str = "", op_block: Optional[Sequence[str]] = None,
              nd_block: Optional[Sequence[str]] = None) -> str:
    """Write the fp16 version of ``onnx_file`` (fp32 inputs and outputs kept) to ``out_file``
    (default ``<name>_fp16.onnx``); ``op_block`` op types and ``nd_block`` node names stay fp32."""
    onnx = require("onnx")
    _require_file(onnx_file)
    out_file = out_file or os.path.splitext(onnx_file)[0] + "_fp16.onnx"
    with staging(os.path.dirname(os.path.abspath(out_file))) as stage:
        src = stage.path("source.onnx")
        onnx.save(onnx_model if onnx_model is not None else onnx.load(onnx_file), src)
        staged = onnx_format.write_fp16(src, stage.path(os.path.basename(out_file)), op_block, nd_block)
        _check_onnx(onnx_file, staged, "fp16")
        stage.publish([(staged, out_file)])
    return out_file


def _write_checked(onnx_file: str, proto: Any, out_file: str, precision: str) -> str:
    onnx = require("onnx")
    with staging(os.path.dirname(os.path.abspath(out_file))) as stage:
        staged = stage.path(os.path.basename(out_file))
        onnx.save(proto, staged)
        if os.path.isfile(onnx_file):
            _check_onnx(onnx_file, staged, precision)
        stage.publish([(staged, out_file)])
    return out_file


def _check_onnx(onnx_file: str, staged: str, precision: str) -> None:
    from basetrainer.deploy.engines.onnx_runtime import ONNXEngine

    check_against_onnx(onnx_file, ONNXEngine(staged, use_gpu=False, quant=1 if precision == "fp16" else 0), precision)


def convert2mnn(onnx_file: str, shape1: Optional[Sequence[int]] = None, shape2: Optional[Sequence[int]] = None,
                out_file: str = "", fp16: bool = False) -> str:
    """Convert ``onnx_file`` to MNN at ``out_file`` (default ``<name>.mnn``), checked; return it.

    ``shape1`` is the input shape the check runs (default: the file's); ``shape2`` is accepted
    for the original's signature (the MNN model takes any batch).
    """
    from basetrainer.deploy.engines.mnn_runtime import MNNEngine

    _require_file(onnx_file)
    out_file = out_file or os.path.splitext(onnx_file)[0] + ".mnn"
    with staging(os.path.dirname(os.path.abspath(out_file))) as stage:
        staged = converters.write_mnn(onnx_file, stage.path(os.path.basename(out_file)), fp16=fp16)
        check_against_onnx(onnx_file, MNNEngine(staged, quant=0), "fp16" if fp16 else "fp32", shape1)
        stage.publish([(staged, out_file)])
    return out_file


def convert2ncnn(onnx_file: str, shape1: Optional[Sequence[int]] = None, shape2: Optional[Sequence[int]] = None,
                 out_file: str = "", fp16: bool = True) -> List[str]:
    """Convert ``onnx_file`` to NCNN with pnnx: ``<out_file>`` (``.param``; default
    ``<name>.ncnn.param``) and the ``.bin`` beside it, checked; return both paths."""
    from basetrainer.deploy.engines.ncnn_runtime import NCNNEngine

    _require_file(onnx_file)
    dims = _shape(onnx_file, shape1)
    param = out_file or os.path.splitext(onnx_file)[0] + ".ncnn.param"
    binary = os.path.splitext(param)[0] + ".bin"
    with staging(os.path.dirname(os.path.abspath(param))) as stage:
        sp, sb = stage.path(os.path.basename(param)), stage.path(os.path.basename(binary))
        converters.write_ncnn(onnx_file, sp, sb, dims, fp16=fp16)
        check_against_onnx(onnx_file, NCNNEngine(sp, sb, quant=int(fp16)), "fp16" if fp16 else "fp32", dims)
        stage.publish([(sb, binary), (sp, param)])
    return [param, binary]
