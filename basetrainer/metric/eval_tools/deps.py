"""The optional packages of the evaluation tools, imported when used; a missing one is an
ImportError naming the pip command. Figures are drawn on matplotlib's Agg canvas."""
import importlib
import io
import os
from typing import Any, Optional

from basetrainer.runtime.errors import MissingExtraError

INSTALL = 'pip install "basetrainer[eval]"'


def need(module: str, what: str = "the evaluation tools") -> Any:
    """Import ``module``; if it is missing, an ImportError naming the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = {"sklearn": "scikit-learn", "torchcam": "torchcam", "pycocotools": "pycocotools"}.get(
            module.split(".")[0], module.split(".")[0])
        raise MissingExtraError(f"{what} need(s) {package}, which is not installed ({e}): {INSTALL}") from e


def sklearn_metrics() -> Any:
    return need("sklearn.metrics")


def figure(width: float = 6.4, height: float = 4.8) -> Any:
    """A matplotlib Figure on the Agg canvas (pyplot's backend and state are left alone)."""
    need("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def save(fig: Any, filename: Optional[str]) -> Optional[str]:
    """Write ``fig`` as a PNG to ``filename`` atomically (nothing when it is empty); return it."""
    if not filename:
        return None
    from basetrainer.runtime import atomic

    folder = os.path.dirname(os.path.abspath(filename))
    os.makedirs(folder, exist_ok=True)
    return atomic.write_atomically(png_bytes(fig), filename)


def as_numpy(values: Any, name: str, dtype: Any = None) -> Any:
    """``values`` (a list, numpy array or tensor) as a numpy array."""
    import numpy as np

    if hasattr(values, "detach"):
        values = values.detach().cpu()
        if str(values.dtype) in ("torch.bfloat16", "torch.float16"):
            values = values.float()
        values = values.numpy()
    try:
        return np.asarray(values, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a list, numpy array or tensor of numbers ({e})") from None


def same_length(**arrays: Any) -> int:
    """The common length of the named arrays; a ValueError naming them when they differ."""
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"these must hold one entry per sample: {lengths}")
    return next(iter(lengths.values()))
