"""``onnx2trt``: the original's ONNX -> TensorRT entry point. TensorRT needs an NVIDIA GPU."""
from typing import Optional, Sequence

from basetrainer.deploy.converters import check_tensorrt


def onnx2trt(onnx_file: str, trt_file: Optional[str] = None, input_shape: Sequence[int] = (1, 3, 160, 160),
             max_batch_size: int = 8, fp16: bool = True) -> str:
    """Raises the error that says what TensorRT needs here (the tensorrt package, an NVIDIA GPU)."""
    check_tensorrt()
    raise RuntimeError("unreachable: check_tensorrt always raises")   # pragma: no cover
