"""The export formats by name: what each writes, what runs it, and the precision it is held to.

==============  ==========================================  =========  ============================
name            files (in the output folder)                precision  runtime
==============  ==========================================  =========  ============================
``onnx``        ``<name>.onnx``                              fp32       ONNX Runtime
``onnx-fp16``   ``<name>_fp16.onnx``                         fp16       ONNX Runtime
``onnx-int8``   ``<name>_int8.onnx``                         int8       ONNX Runtime (calibrated)
``mnn``         ``<name>.mnn``                               fp32       MNN
``ncnn``        ``<name>.ncnn.param``, ``.ncnn.bin``         fp32       NCNN, every fp16 option off
``ncnn-fp16``   ``<name>_fp16.ncnn.param``, ``.bin``         fp16       NCNN's defaults (fp16 storage)
``openvino``    ``<name>.xml``, ``<name>.bin``               fp32       OpenVINO, f32 precision hint
``tensorrt``    needs an NVIDIA GPU (not available here)
``rknn``        needs a Rockchip NPU (not available here)
==============  ==========================================  =========  ============================
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from torch import nn

from basetrainer.deploy import converters, onnx_format
from basetrainer.deploy.engines.base import InferenceEngine
from basetrainer.deploy.files import Staging
from basetrainer.deploy.runtimes import MissingRuntimeError, missing, pip_command


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's state dict: what its files hold at least, in fp32."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


class Job:
    """What the writers of one export run share: the model, its input, the staging folder, and
    the fp32 ONNX file (written once, on first use, into a folder of its own that stays)."""

    def __init__(self, model: nn.Module, input_shape: Sequence[int], stage: Staging, stem: str,
                 exporter: str = "auto", opset: Optional[int] = None, simplify: bool = True,
                 calibration: Optional[np.ndarray] = None, dynamic: bool = True,
                 names: Tuple[Sequence[str], Sequence[str]] = (("input",), ("output",))) -> None:
        self.model, self.input_shape, self.stage, self.stem = model, tuple(input_shape), stage, stem
        self.exporter, self.opset, self.simplify, self.calibration = exporter, opset, simplify, calibration
        self.dynamic, self.names = dynamic, names
        self.weight_bytes = weight_bytes(model)
        self._onnx: Optional[str] = None
        self._onnx_error: Optional[BaseException] = None

    def onnx(self) -> str:
        """The fp32 ONNX file (a failed export is not tried again for the next format)."""
        if self._onnx_error is not None:
            raise self._onnx_error
        if self._onnx is None:
            try:
                with self.stage.attempt("the ONNX file", self.weight_bytes, keep=True) as part:
                    self._onnx = onnx_format.write_onnx(
                        self.model, part.path(f"{self.stem}.onnx"), self.input_shape, self.names[0], self.names[1],
                        dynamic=self.dynamic, opset=self.opset, exporter=self.exporter, simplify=self.simplify)
            except Exception as e:
                self._onnx_error = e
                raise
        return self._onnx


@dataclass(frozen=True)
class Format:
    """One format: ``write(job, part)`` writes its files into ``part`` (its own folder inside the
    staging folder) and returns them (data files before the files naming them, the order they
    are published in); ``load(files, threads)`` builds its engine."""
    name: str
    precision: str                      # a key of basetrainer.deploy.parity.BOUNDS
    modules: Tuple[str, ...]            # the runtimes it needs (runtimes.PACKAGES keys)
    write: Callable[[Job, Staging], List[str]]
    load: Callable[[List[str], Optional[int]], InferenceEngine]
    runtime: str


def _onnx_engine(quant: int) -> Callable[[List[str], Optional[int]], InferenceEngine]:
    def load(files: List[str], threads: Optional[int]) -> InferenceEngine:
        from basetrainer.deploy.engines.onnx_runtime import ONNXEngine

        return ONNXEngine(files[0], use_gpu=False, quant=quant, num_thread=threads)
    return load


def _write_fp16(job: Job, part: Staging) -> List[str]:
    return [onnx_format.write_fp16(job.onnx(), part.path(f"{job.stem}_fp16.onnx"))]


def _write_int8(job: Job, part: Staging) -> List[str]:
    if job.calibration is None:
        raise ValueError("onnx-int8 is calibrated on training images: pass calibration (--calibration "
                         "<train ImageFolder>)")
    return [onnx_format.write_int8(job.onnx(), part.path(f"{job.stem}_int8.onnx"), job.calibration)]


def _write_mnn(job: Job, part: Staging) -> List[str]:
    return [converters.write_mnn(job.onnx(), part.path(f"{job.stem}.mnn"))]


def _load_mnn(files: List[str], threads: Optional[int]) -> InferenceEngine:
    from basetrainer.deploy.engines.mnn_runtime import MNNEngine

    return MNNEngine(files[0], quant=0, num_thread=threads or 4)


def _ncnn(fp16: bool) -> Tuple[Callable[[Job, Staging], List[str]],
                              Callable[[List[str], Optional[int]], InferenceEngine]]:
    tag = "_fp16" if fp16 else ""

    def write(job: Job, part: Staging) -> List[str]:
        param = part.path(f"{job.stem}{tag}.ncnn.param")
        binary = part.path(f"{job.stem}{tag}.ncnn.bin")
        converters.write_ncnn(job.model, param, binary, job.input_shape, fp16=fp16)
        return [binary, param]

    def load(files: List[str], threads: Optional[int]) -> InferenceEngine:
        from basetrainer.deploy.engines.ncnn_runtime import NCNNEngine

        return NCNNEngine(files[1], files[0], num_thread=threads, quant=int(fp16))
    return write, load


def _write_openvino(job: Job, part: Staging) -> List[str]:
    xml, binary = converters.write_openvino(job.onnx(), part.path(f"{job.stem}.xml"))
    return [binary, xml]


def _load_openvino(files: List[str], threads: Optional[int]) -> InferenceEngine:
    from basetrainer.deploy.engines.openvino_runtime import OpenVINOEngine

    return OpenVINOEngine(files[1], quant=0, num_thread=threads)


def _hardware(which: str) -> Callable:
    """Both halves of a hardware format raise the error that says what is missing."""
    def refuse(*args: object) -> List[str]:
        from basetrainer.deploy.engines.hardware import RKNNEngine, TRTEngine

        TRTEngine("model.onnx") if which == "tensorrt" else RKNNEngine("model.onnx")
        raise RuntimeError(f"{which} engine did not refuse")   # pragma: no cover - both always raise
    return refuse


_ONNX = ("onnx", "onnxruntime", "onnxslim")
FORMATS: Dict[str, Format] = {
    "onnx": Format("onnx", "fp32", _ONNX, lambda job, part: [job.onnx()], _onnx_engine(0), "ONNX Runtime"),
    "onnx-fp16": Format("onnx-fp16", "fp16", _ONNX, _write_fp16, _onnx_engine(1), "ONNX Runtime"),
    "onnx-int8": Format("onnx-int8", "int8", _ONNX, _write_int8, _onnx_engine(2), "ONNX Runtime"),
    "mnn": Format("mnn", "fp32", _ONNX + ("MNN",), _write_mnn, _load_mnn, "MNN"),
    "ncnn": Format("ncnn", "fp32", ("pnnx", "ncnn"), *_ncnn(False), runtime="NCNN"),
    "ncnn-fp16": Format("ncnn-fp16", "fp16", ("pnnx", "ncnn"), *_ncnn(True), runtime="NCNN"),
    "openvino": Format("openvino", "fp32", _ONNX + ("openvino",), _write_openvino, _load_openvino, "OpenVINO"),
    "tensorrt": Format("tensorrt", "fp16", ("tensorrt",), _hardware("tensorrt"), _hardware("tensorrt"), "TensorRT"),
    "rknn": Format("rknn", "fp16", ("rknn.api",), _hardware("rknn"), _hardware("rknn"), "RKNN"),
}
HARDWARE = ("tensorrt", "rknn")


def parse_formats(formats: object) -> List[Format]:
    """``"onnx,mnn"`` or ``["onnx", "mnn"]`` as formats (in that order, once each).

    Raises:
        ValueError: an unknown name (the valid ones listed) or none at all.
    """
    names = formats.split(",") if isinstance(formats, str) else list(formats or [])  # type: ignore[call-overload]
    names = [str(n).strip().lower() for n in names if str(n).strip()]
    if not names:
        raise ValueError(f"no format given; choose from {sorted(FORMATS)}")
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        raise ValueError(f"unknown format {', '.join(map(repr, unknown))}; choose from {sorted(FORMATS)} "
                         f"(comma-separated, e.g. --format onnx,mnn,ncnn,openvino)")
    return [FORMATS[n] for n in dict.fromkeys(names)]


def check_installed(formats: Sequence[Format], simplify: bool = True) -> None:
    """Raise one :class:`MissingRuntimeError` naming every runtime the formats need and lack
    (onnxslim only to ``simplify``)."""
    def needs(f: Format) -> List[str]:
        return [m for m in f.modules if simplify or m != "onnxslim"]

    needed = [m for f in formats if f.name not in HARDWARE for m in needs(f)]
    absent = missing(list(dict.fromkeys(needed)))
    if absent:
        by_format = {f.name: [m for m in needs(f) if m in absent] for f in formats}
        lines = [f"{name}: {', '.join(mods)}" for name, mods in by_format.items() if mods]
        raise MissingRuntimeError("runtimes missing for the formats asked for: " + " | ".join(lines)
                                  + f"; install them: {pip_command(*absent)}")
