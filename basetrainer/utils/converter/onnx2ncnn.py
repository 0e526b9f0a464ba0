"""``convert2ncnn``: the original's ONNX -> NCNN (pnnx) entry point (see :mod:`basetrainer.deploy.from_onnx`)."""
from typing import Any, List, Optional, Sequence

from basetrainer.deploy import from_onnx


def convert2ncnn(onnx_file: str, shape1: Sequence[int], shape2: Optional[Sequence[int]] = None, out_file: str = "",
                 fp16: bool = True, use_prune: bool = False, sparsity: float = 0.2, device: str = "cpu",
                 **kwargs: Any) -> List[str]:
    """Convert ``onnx_file`` with pnnx to ``.ncnn.param`` / ``.bin`` (checked against ONNX
    Runtime); returns both paths. ``use_prune`` cannot apply to an ONNX file and is refused."""
    if use_prune:
        raise ValueError("use_prune=True needs the PyTorch model: prune it and export again with "
                         "basetrainer.utils.converter.pytorch2ncnn.convert2ncnn(model, ..., use_prune=True)")
    return from_onnx.convert2ncnn(onnx_file, shape1, shape2, out_file=out_file, fp16=fp16)
