"""``convert2mnn``: the original's ONNX -> MNN entry point (see :mod:`basetrainer.deploy.from_onnx`)."""
from basetrainer.deploy.from_onnx import convert2mnn

__all__ = ["convert2mnn"]
