"""ONNX Runtime: :class:`ONNXEngine`, the original's engine with its keywords.

``quant=1`` converts an fp32 model to fp16 in memory (inputs and outputs stay fp32); ``quant=2``
quantizes it to int8 with ONNX Runtime's static quantization, calibrated on the images given as
``calibration``. A model that already is fp16 or int8 is run as it is.
"""
import logging
import os
import tempfile
from typing import Any, List, Optional, Sequence

import numpy as np

from basetrainer.deploy import onnx_format
from basetrainer.deploy.engines.base import InferenceEngine, check_quant, fall_back_to_cpu
from basetrainer.deploy.runtimes import require

logger = logging.getLogger(__name__)


def _is_fp16(proto: Any) -> bool:
    return any(init.data_type == 10 for init in proto.graph.initializer)   # TensorProto.FLOAT16


def _is_quantized(proto: Any) -> bool:
    return any(node.op_type in ("QuantizeLinear", "QLinearConv", "ConvInteger") for node in proto.graph.node)


class ONNXEngine(InferenceEngine):
    """Run an ONNX model with ONNX Runtime.

    Args:
        model_file: the ``.onnx`` file.
        use_gpu: use CUDA when onnxruntime has its CUDA provider (else a warning, and the CPU).
        quant: 0 fp32, 1 fp16 (converted on load), 2 int8 (quantized on load with ``calibration``).
        simplify: simplify the graph with onnxslim on load.
        dynamic: the model takes any batch (``False``: samples are run one at a time).
        device_id: the CUDA device.
        num_thread: ONNX Runtime's intra-op threads (``None``: its default, one per core).
        calibration: ``(N, C, H, W)`` images for ``quant=2``.
        op_block: op types kept in fp32 by ``quant=1``.
        nd_block: node names kept in fp32 by ``quant=1``.

    Example::

        engine = ONNXEngine("model.onnx", use_gpu=False)
        logits = engine(images)[0]           # images: (N, 3, H, W) numpy array or tensor
        latency = engine.performance(images[:1], iterate=50)
    """

    name = "onnxruntime"

    def __init__(self, model_file: str, use_gpu: bool = True, quant: int = 0, simplify: bool = False,
                 dynamic: bool = True, device_id: int = 0, num_thread: Optional[int] = None,
                 calibration: Optional[np.ndarray] = None, op_block: Optional[Sequence[str]] = None,
                 nd_block: Optional[Sequence[str]] = None, **kwargs: Any) -> None:
        super().__init__(check_quant(quant, "ONNXEngine"), dynamic)
        if kwargs:
            logger.warning("ONNXEngine ignores the keywords %s", sorted(kwargs))
        ort = require("onnxruntime")
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"ONNX file {model_file!r} does not exist; export it first "
                                    f"(python -m basetrainer.deploy CHECKPOINT --format onnx)")
        content: Any = model_file
        if simplify or quant:
            content = self._prepare(model_file, simplify, quant, calibration, op_block, nd_block)
        options = ort.SessionOptions()
        options.log_severity_level = 3   # errors only
        if num_thread:
            options.intra_op_num_threads = int(num_thread)
        providers: List[Any] = ["CPUExecutionProvider"]
        if use_gpu:
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, ("CUDAExecutionProvider", {"device_id": int(device_id)}))
            else:
                fall_back_to_cpu("ONNXEngine", "onnxruntime has no CUDA provider here (pip install onnxruntime-gpu)")
        try:
            self.onnx_session = ort.InferenceSession(content, sess_options=options, providers=providers)
        except Exception as e:
            raise ValueError(f"ONNX Runtime cannot load {model_file!r} ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); re-export it") from e
        self.device = self.onnx_session.get_providers()
        inputs = self.onnx_session.get_inputs()
        self.inp_names = [i.name for i in inputs]
        self.out_names = [o.name for o in self.onnx_session.get_outputs()]
        self._input_type = np.float16 if inputs[0].type == "tensor(float16)" else np.float32
        shape = list(inputs[0].shape)
        self.input_shape = tuple(d if isinstance(d, int) else None for d in shape[1:]) if len(shape) >= 2 else None
        if isinstance(shape[0] if shape else None, int) and shape[0] == 1:
            self.dynamic = False   # exported with a fixed batch of 1: feed the samples in turn
        logger.info("ONNXEngine: %s on %s, %s, inputs %s -> outputs %s", model_file, self.device[0],
                    {0: "fp32", 1: "fp16", 2: "int8"}[self.quant], self.inp_names, self.out_names)

    @staticmethod
    def _prepare(model_file: str, simplify: bool, quant: int, calibration: Optional[np.ndarray],
                 op_block: Optional[Sequence[str]], nd_block: Optional[Sequence[str]]) -> bytes:
        onnx = require("onnx")
        proto = onnx.load(model_file)
        if simplify:
            proto = onnx_format.simplify_proto(proto)
        with tempfile.TemporaryDirectory(prefix="basetrainer-onnx-") as tmp:
            src = os.path.join(tmp, "model.onnx")
            onnx.save(proto, src)
            if quant == 1 and not _is_fp16(proto):
                src = onnx_format.write_fp16(src, os.path.join(tmp, "model_fp16.onnx"), op_block, nd_block)
            elif quant == 2 and not _is_quantized(proto):
                if calibration is None:
                    raise ValueError("ONNXEngine(quant=2) quantizes the model to int8 and needs calibration "
                                     "images: pass calibration=<(N, C, H, W) array of training images>, or load "
                                     "an int8 file made by python -m basetrainer.deploy --format onnx-int8")
                src = onnx_format.write_int8(src, os.path.join(tmp, "model_int8.onnx"), calibration)
            with open(src, "rb") as f:
                return f.read()

    def get_inp_names(self, onnx_session: Any = None) -> List[str]:
        return [i.name for i in (onnx_session or self.onnx_session).get_inputs()]

    def get_out_names(self, onnx_session: Any = None) -> List[str]:
        return [o.name for o in (onnx_session or self.onnx_session).get_outputs()]

    def get_inp_feed(self, input_name: Sequence[str], image_tensor: np.ndarray) -> dict:
        return {name: image_tensor for name in input_name}

    def _run(self, batch: np.ndarray) -> List[np.ndarray]:
        feed = self.get_inp_feed(self.inp_names, batch.astype(self._input_type, copy=False))
        outputs = self.onnx_session.run(self.out_names, feed)
        return [o.astype(np.float32) if o.dtype == np.float16 else o for o in outputs]
