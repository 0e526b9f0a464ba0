"""The original's TensorRT engine path: ``TRTEngine``, ``onnx2trt``. They need an NVIDIA GPU
and the tensorrt package; building one without them is one clear error."""
from basetrainer.deploy.engines.hardware import TRTEngine
from basetrainer.utils.converter.onnx2trt import onnx2trt

__all__ = ["TRTEngine", "onnx2trt"]
