"""MNN, NCNN and OpenVINO files from an ONNX file or a PyTorch model.

- MNN: MNN's converter (``_tools`` of the ``mnn`` wheel, run in a child process; see
  :func:`basetrainer.deploy.runtimes.mnn_converter`). ``fp16`` stores the weights in fp16.
- NCNN: pnnx (the converter the ncnn project maintains) from the traced PyTorch model or from
  an ONNX file; ``fp16`` stores the weights in fp16 (pnnx's default, which we do not take:
  fp32 unless asked).
- OpenVINO IR (``.xml`` + ``.bin``): OpenVINO's ONNX frontend (``Core.read_model``) on the ONNX
  file; weights stay fp32 unless ``fp16`` (``save_model`` would compress them to fp16 by default).
- TensorRT needs an NVIDIA GPU: :func:`check_tensorrt` says what is missing.

Each function writes its files at the paths given and checks that they are there; callers
stage them (:mod:`.files`). A converter that fails raises :class:`ExportError` with its output.
"""
import io
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import warnings
from typing import List, Sequence, Union

import torch
from torch import nn

from basetrainer.deploy.onnx_format import ExportError
from basetrainer.deploy.runtimes import MissingRuntimeError, mnn_converter, pnnx_binary, require
from basetrainer.deploy.signal_stack import kept_signal_stack

logger = logging.getLogger(__name__)

TIMEOUT = 1800   # seconds a converter may take before it is stopped


def _run(command: List[str], what: str, cwd: str) -> str:
    logger.debug("running %s", " ".join(command))
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ExportError(f"{what} did not finish within {TIMEOUT} s and was stopped") from None
    output = (done.stdout or "") + (done.stderr or "")
    if done.returncode < 0:   # killed (SIGKILL: the OOM killer, a user) or aborted (SIGABRT)
        raise ExportError(f"{what} was killed by {_signal_name(-done.returncode)} (exit code {done.returncode}): "
                          f"{_tail(output) or 'no output'}")
    if done.returncode != 0:
        raise ExportError(f"{what} failed (exit code {done.returncode}): {_tail(output)}")
    logger.debug("%s: %s", what, _tail(output, 2000))
    return output


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(text: str, limit: int = 1200) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def _check_written(paths: Sequence[str], what: str, output: str) -> None:
    absent = [p for p in paths if not os.path.isfile(p) or os.path.getsize(p) == 0]
    if absent:
        raise ExportError(f"{what} wrote no {', '.join(os.path.basename(p) for p in absent)}: {_tail(output)}")


# ----------------------------------------------------------------------------- MNN
def write_mnn(onnx_file: str, out_file: str, fp16: bool = False) -> str:
    """Convert ``onnx_file`` to MNN's format at ``out_file``."""
    if not os.path.isfile(onnx_file):
        raise FileNotFoundError(f"ONNX file {onnx_file!r} does not exist; export the model to ONNX first")
    command = mnn_converter() + ["-f", "ONNX", "--modelFile", os.path.abspath(onnx_file),
                                 "--MNNModel", os.path.abspath(out_file), "--bizCode", "basetrainer"]
    if fp16:
        command.append("--fp16")
    output = _run(command, "MNN's converter", cwd=os.path.dirname(os.path.abspath(out_file)))
    _check_written([out_file], "MNN's converter", output)
    if "Converted Success" not in output:
        raise ExportError(f"MNN's converter did not report success: {_tail(output)}")
    return out_file


# ----------------------------------------------------------------------------- NCNN
def write_ncnn(source: Union[nn.Module, str], param_file: str, bin_file: str, input_shape: Sequence[int],
               fp16: bool = False) -> List[str]:
    """Convert a PyTorch model (traced) or an ONNX file to NCNN's ``.param`` and ``.bin`` with pnnx.

    ``input_shape`` is ``(N, C, H, W)`` (or ``N`` and other sizes); NCNN runs one sample at a time, so the batch is 1. pnnx
    works in a folder beside ``param_file``, removed when it succeeds; when it fails the folder
    is left to the staging folder around it (:mod:`.files`), which judges the disk first.
    """
    binary = pnnx_binary()
    sizes = [int(v) for v in input_shape[1:]]
    work = tempfile.mkdtemp(prefix="pnnx-", dir=os.path.dirname(os.path.abspath(param_file)))
    if isinstance(source, nn.Module):
        model_file = os.path.join(work, "model.pt")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch.jit.trace is deprecated; pnnx reads TorchScript
            try:
                traced = torch.jit.trace(source, torch.randn(1, *sizes))
            except Exception as e:
                raise ExportError(f"tracing {type(source).__name__} for pnnx failed ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); try the ONNX route "
                                  f"(basetrainer.utils.converter.onnx2ncnn)") from e
        # saved to memory, then written: torch's zip writer aborts the process (c10::Error thrown
        # from its destructor) when the disk fills up under it; a plain write raises ENOSPC
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
        with open(model_file, "wb") as f:
            f.write(buffer.getbuffer())
    else:
        if not os.path.isfile(source):
            raise FileNotFoundError(f"ONNX file {source!r} does not exist; export the model to ONNX first")
        model_file = os.path.join(work, "model.onnx")   # pnnx writes <name>.pnnxsim.onnx beside its input
        shutil.copyfile(source, model_file)
    side = {k: os.path.join(work, f"side.{k}") for k in ("pnnxparam", "pnnxbin", "pnnxpy", "pnnxonnx", "ncnnpy")}
    command = [binary, model_file, f"inputshape=[1,{','.join(map(str, sizes))}]f32", f"fp16={int(bool(fp16))}",
               f"ncnnparam={os.path.abspath(param_file)}", f"ncnnbin={os.path.abspath(bin_file)}"]
    command += [f"{k}={v}" for k, v in side.items()]
    output = _run(command, "pnnx", cwd=work)
    _check_written([param_file, bin_file], "pnnx", output)
    shutil.rmtree(work, ignore_errors=True)
    return [param_file, bin_file]


# ----------------------------------------------------------------------------- OpenVINO
def write_openvino(onnx_file: str, xml_file: str, fp16: bool = False) -> List[str]:
    """Convert ``onnx_file`` to OpenVINO IR: ``xml_file`` and the ``.bin`` beside it."""
    ov = require("openvino")
    if not os.path.isfile(onnx_file):
        raise FileNotFoundError(f"ONNX file {onnx_file!r} does not exist; export the model to ONNX first")
    try:
        # Core.read_model, not openvino.convert_model: the same ONNX frontend, without the model
        # converter's usage telemetry (sent by default when no consent file exists)
        with kept_signal_stack():   # OpenVINO may swap the thread's signal stack (see deploy.signal_stack)
            model = ov.Core().read_model(onnx_file)
            ov.save_model(model, xml_file, compress_to_fp16=bool(fp16))
    except Exception as e:
        raise ExportError(f"OpenVINO could not convert {onnx_file!r} ({type(e).__name__}: "
                          f"{_tail(str(e), 600)})") from e
    bin_file = os.path.splitext(xml_file)[0] + ".bin"
    _check_written([xml_file, bin_file], "OpenVINO", "")
    return [xml_file, bin_file]


# ----------------------------------------------------------------------------- TensorRT
def check_tensorrt() -> None:
    """Raise the one clear error that says what TensorRT needs here and is missing."""
    require("tensorrt")
    if not torch.cuda.is_available():
        raise MissingRuntimeError("TensorRT needs an NVIDIA GPU with CUDA, and torch sees none here "
                                  "(torch.cuda.is_available() is False); run on a machine with one")
    raise NotImplementedError("TensorRT export has not been run or verified in this release (no GPU was "
                              "available to test it); build the engine from the checked ONNX file with "
                              "trtexec --onnx=<model.onnx> --saveEngine=<model.trt>")
