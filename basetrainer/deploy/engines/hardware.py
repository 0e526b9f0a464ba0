"""Engines bound to hardware this project cannot test: :class:`TRTEngine` (an NVIDIA GPU with
TensorRT) and :class:`RKNNEngine` (a Rockchip NPU with RKNN-Toolkit2 / -Lite2).

They import without their runtime, keep the original's keywords, and building one says in one
error what is missing: the package (with its pip command) and the hardware. Where both are
present they still refuse, because no run of them has checked their answers against eager
PyTorch (no GPU or Rockchip board was available); the error gives the vendor tool to use on the
checked ONNX file instead.
"""
import logging
from typing import Any, Optional, Sequence

from basetrainer.deploy.converters import check_tensorrt
from basetrainer.deploy.runtimes import MissingRuntimeError, require

logger = logging.getLogger(__name__)


class TRTEngine:
    """TensorRT engine (original keywords: ``model_file``, ``input_shape``, ``quant``, ``calibrator``).

    Raises:
        MissingRuntimeError: tensorrt is not installed, or there is no CUDA GPU.
        NotImplementedError: both are there, but this engine has not been verified on them.
    """

    def __init__(self, model_file: str, input_shape: Optional[Sequence[int]] = None, quant: int = 1,
                 calibrator: Any = None, use_gpu: bool = True, device_id: int = 0, **kwargs: Any) -> None:
        self.model_file, self.input_shape, self.quant = model_file, input_shape, quant
        check_tensorrt()


class RKNNEngine:
    """RKNN engine for Rockchip NPUs (original keywords: ``model_file``, ``shape``, ``device``,
    ``quant``, ``simplify``, ``dynamic``, ``dynamic_shape``).

    Raises:
        MissingRuntimeError: neither rknn-toolkit2 (PC) nor rknn-toolkit-lite2 (board) is installed.
        NotImplementedError: one is, but this engine has not been verified on Rockchip hardware.
    """

    def __init__(self, model_file: str, shape: Sequence[int] = (1, 3, 224, 224), device: Optional[str] = None,
                 quant: int = 0, simplify: bool = True, dynamic: bool = True, dynamic_shape: Any = None,
                 use_gpu: bool = False, device_id: int = 0, **kwargs: Any) -> None:
        self.model_file, self.shape, self.quant = model_file, tuple(shape), quant
        found = None
        for module in ("rknnlite.api", "rknn.api"):
            try:
                found = require(module)
                break
            except MissingRuntimeError:
                continue
        if found is None:
            raise MissingRuntimeError("RKNNEngine needs Rockchip's RKNN runtime and a Rockchip NPU (RK3566, RK3568, "
                                      "RK3576, RK3588, RV1106, ...): on the board pip install rknn-toolkit-lite2, "
                                      "on a PC (simulator and conversion) pip install rknn-toolkit2; neither is "
                                      "installed here")
        raise NotImplementedError("RKNNEngine has not been run or verified on Rockchip hardware in this release; "
                                  "convert the checked ONNX file with RKNN-Toolkit2 (rknn.config/load_onnx/build/"
                                  "export_rknn) and run it with RKNNLite on the board")
