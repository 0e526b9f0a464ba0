"""``OpenVINOEngine`` beside the original's engines (implemented in :mod:`basetrainer.deploy`)."""
from basetrainer.deploy.engines.openvino_runtime import OpenVINOEngine

__all__ = ["OpenVINOEngine"]
