"""The original's ONNX Runtime engine path: ``ONNXEngine``, ``simplify_onnx``, ``onnx_fp16``
(implemented in :mod:`basetrainer.deploy`)."""
from basetrainer.deploy.engines.onnx_runtime import ONNXEngine
from basetrainer.deploy.from_onnx import onnx_fp16, simplify_onnx

__all__ = ["ONNXEngine", "simplify_onnx", "onnx_fp16"]
