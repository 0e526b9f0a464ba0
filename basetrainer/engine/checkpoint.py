"""Checkpoint files: atomic writes, safe loads, and the state a resume needs.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only, so it loads with
``torch.load(..., weights_only=True)``: a file that carries pickled code is refused.
"""
import glob
import logging
import os
import pickle
import random
import zipfile
from typing import Any, Dict, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

FORMAT = "basetrainer-checkpoint-1"


def atomic_save(obj: Any, path: str) -> str:
    """``torch.save`` to a temp file in the same folder, fsync, then rename over ``path``.

    A crash at any point leaves either the old file or the new one, never a torn one.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some filesystems cannot fsync a folder; the rename is still atomic
        pass
    return path


def load_file(path: str, map_location: Any = "cpu") -> Any:
    """Load a ``.pth`` with ``weights_only=True``; every failure names the file and the problem.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is truncated, not a torch file, or carries pickled code (refused).
    """
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path!r} does not exist; check the path "
                                f"(finetune/resume/pretrained keys)")
    if os.path.getsize(path) == 0:
        raise ValueError(f"checkpoint file {path!r} is empty (0 bytes): it was not written completely")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # every weights-only failure mentions "weights_only"; only a blocked GLOBAL is pickled code
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = next((line for line in lines if "unsupported" in line.lower()), lines[0] if lines else "")
        if "unsupported global" in str(e).lower():
            raise ValueError(f"refused to load {path!r}: it holds pickled Python objects that would run "
                             f"code when loaded (only tensors, numbers, strings, lists and dicts are "
                             f"accepted). Re-save it as a plain state_dict. Details: {detail}"
                             ) from None
        raise ValueError(f"checkpoint file {path!r} is truncated or not a torch file ({detail})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"checkpoint file {path!r} is truncated or not a torch file "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def extract_state_dict(obj: Any, source: str = "checkpoint") -> Dict[str, torch.Tensor]:
    """The model weights inside a loaded file (a state_dict, or a checkpoint's ``model`` or
    ``state_dict`` entry), without a DataParallel/DDP ``module.`` prefix."""
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    elif isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{source} does not hold a model state_dict (a dict of tensors)")
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def rng_state() -> Dict[str, Any]:
    """Every random generator's state (python, numpy, torch, CUDA), in weights-only types."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: Dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
        except (RuntimeError, IndexError):
            logger.warning("could not restore the CUDA RNG state (different GPUs?); continuing")


def is_resumable(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("format") == FORMAT


def find_latest(root: str) -> Optional[str]:
    """The most recently written loadable, resumable checkpoint below ``root``, or None.

    Files are tried newest first; unreadable ones (e.g. cut short by a crash) are skipped.
    """
    paths = glob.glob(os.path.join(root, "**", "*.pth"), recursive=True)
    for path in sorted(paths, key=os.path.getmtime, reverse=True):
        try:
            obj = load_file(path)
        except (ValueError, FileNotFoundError):
            logger.warning("resume: skipping %s (not loadable)", path)
            continue
        if is_resumable(obj):
            return path
    return None
