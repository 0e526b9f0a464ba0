"""The optional runtimes: imported on first use, or an error that names the pip command.

Each package is imported only by the function that needs it, so ``import basetrainer`` (and
every module of this package) loads none of them. Some runtimes write to the process's stdout
from C code (``import MNN`` prints the CPU's features); :func:`quiet_stdout` catches that at the
file-descriptor level and hands it to the log instead. Runtimes that report usage to their
vendor by default (OpenVINO at import, MNN's Python converter script) are kept from doing so.
"""
import contextlib
import importlib
import logging
import os
import shutil
import sys
import tempfile
from types import ModuleType
from typing import Dict, Iterator, List, Optional, Tuple

from basetrainer.runtime.errors import MissingExtraError

logger = logging.getLogger(__name__)

# import name -> (pip package, basetrainer extra, what it is for)
PACKAGES: Dict[str, Tuple[str, Optional[str], str]] = {
    "onnx": ("onnx", "export", "ONNX export"),
    "onnxruntime": ("onnxruntime", "export", "ONNX Runtime"),
    "onnxscript": ("onnxscript", "export", "torch's dynamo ONNX exporter"),
    "onnxslim": ("onnxslim", "export", "ONNX simplification"),
    "MNN": ("mnn", "mnn", "MNN"),
    "pnnx": ("pnnx", "ncnn", "NCNN export (pnnx)"),
    "ncnn": ("ncnn", "ncnn", "NCNN"),
    "openvino": ("openvino", "openvino", "OpenVINO"),
    "tensorrt": ("tensorrt", None, "TensorRT (needs an NVIDIA GPU with CUDA)"),
    "rknn.api": ("rknn-toolkit2", None, "RKNN (Rockchip's RKNN-Toolkit2, for a Rockchip NPU)"),
    "rknnlite.api": ("rknn-toolkit-lite2", None, "RKNN on the board (Rockchip's RKNN-Toolkit-Lite2)"),
}


class MissingRuntimeError(MissingExtraError):
    """An optional runtime is not installed; the message names the pip command (an ImportError)."""


def pip_command(*modules: str) -> str:
    """One pip command installing the packages of ``modules`` (keys of :data:`PACKAGES`): the
    basetrainer extras, each once, when every one has an extra; else the packages."""
    packages = " ".join(dict.fromkeys(PACKAGES[m][0] for m in modules))
    extras = list(dict.fromkeys(PACKAGES[m][1] for m in modules))
    if None in extras:
        return f"pip install {packages}"
    return f'pip install "basetrainer[{",".join(extras)}]" (or pip install {packages})'


def require(module: str) -> ModuleType:
    """Import ``module`` (a key of :data:`PACKAGES`) or raise :class:`MissingRuntimeError`."""
    if module not in PACKAGES:
        raise KeyError(f"{module!r} is not a runtime this package knows; known: {sorted(PACKAGES)}")
    try:
        if module == "MNN":
            with quiet_stdout("import MNN"):
                return importlib.import_module(module)
        if module == "openvino" and module not in sys.modules:
            with _blocked("openvino_telemetry"):
                return importlib.import_module(module)
        return importlib.import_module(module)
    except ImportError as e:
        _, _, purpose = PACKAGES[module]
        raise MissingRuntimeError(f"{purpose} needs the {PACKAGES[module][0]!r} package, which cannot be "
                                  f"imported ({e}); install it: {pip_command(module)}") from None


@contextlib.contextmanager
def _blocked(name: str) -> Iterator[None]:
    """Make ``import name`` fail inside the block. ``import openvino`` sends a usage event to
    Intel's telemetry server (and writes ~/intel) unless the user opted out; without its
    ``openvino_telemetry`` package OpenVINO uses its own no-op stub, so an export sends nothing.
    A user who imported openvino before keeps whatever it chose."""
    saved = sys.modules.get(name, _ABSENT)
    sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if saved is _ABSENT:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved  # type: ignore[assignment]


_ABSENT = object()


def missing(modules: List[str]) -> List[str]:
    """The modules of ``modules`` that cannot be imported (without importing the others twice)."""
    absent = []
    for module in modules:
        try:
            require(module)
        except MissingRuntimeError:
            absent.append(module)
    return absent


@contextlib.contextmanager
def quiet_stdout(what: str) -> Iterator[None]:
    """Catch what C code writes to file descriptor 1 during the block and log it at debug level
    (Python's own ``sys.stdout`` is flushed first, so nothing of ours is lost)."""
    try:
        fd = sys.stdout.fileno() if sys.stdout is not None else 1
    except (AttributeError, ValueError, OSError):
        fd = 1
    try:
        saved = os.dup(fd)
    except OSError:     # no descriptor 1 at all: nothing to catch
        yield
        return
    with tempfile.TemporaryFile() as sink:
        if sys.stdout is not None:
            sys.stdout.flush()
        os.dup2(sink.fileno(), fd)
        try:
            yield
        finally:
            try:
                if sys.stdout is not None:
                    sys.stdout.flush()
            finally:
                os.dup2(saved, fd)
                os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace").strip()
            if text:
                logger.debug("%s wrote: %s", what, text)


def mnn_converter() -> List[str]:
    """The command that runs MNN's ONNX converter, found without PATH.

    The ``mnn`` wheel holds the converter as the extension module ``_tools``; it runs in a child
    process of this interpreter (a converter crash cannot take this process down). The wheel's
    ``mnnconvert`` Python script is not used: at import it runs ``pip install`` and sends usage
    logs to a remote server. A native build's ``MNNConvert`` binary, beside this interpreter or
    on PATH, is the fallback.
    """
    require("MNN")
    try:
        with quiet_stdout("import _tools"):
            importlib.import_module("_tools")
        # it returns True whether or not it converted: the caller checks the file it wrote
        return [sys.executable, "-c", "import sys, _tools; _tools.mnnconvert(sys.argv)"]
    except ImportError:
        pass
    here = os.path.join(os.path.dirname(sys.executable), "MNNConvert")
    found = here if os.access(here, os.X_OK) else shutil.which("MNNConvert")
    if not found:
        raise MissingRuntimeError(f"MNN's converter is missing: the installed MNN package has no '_tools' module "
                                  f"and no MNNConvert binary was found; reinstall it: {pip_command('MNN')}")
    return [found]


def pnnx_binary() -> str:
    """The pnnx executable shipped inside the ``pnnx`` wheel (never looked up on PATH)."""
    pnnx = require("pnnx")
    path = getattr(pnnx, "EXEC_PATH", None)
    if not path or not os.access(path, os.X_OK):
        raise MissingRuntimeError(f"the pnnx package has no runnable pnnx binary ({path!r}); reinstall it: "
                                  f"{pip_command('pnnx')}")
    return path
