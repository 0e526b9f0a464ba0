"""Checkpoint files: atomic writes, safe loads, and the state a resume needs.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only, so it loads with
``torch.load(..., weights_only=True)``: a file that carries pickled code is refused.
"""
import glob
import logging
import os
import pickle
import random
import threading
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

FORMAT = "basetrainer-checkpoint-1"


def atomic_save(obj: Any, path: str) -> str:
    """``torch.save`` to a temp file in the same folder, fsync, then rename over ``path``.

    A crash at any point leaves either the old file or the new one, never a torn one. Waits
    first for the checkpoint writes still running in the background (:func:`write_in_background`),
    so files are always written in the order they were asked for.
    """
    wait_for_writes()
    return write_atomically(obj, path)


def write_atomically(obj: Any, path: str) -> str:
    """:func:`atomic_save` without waiting for the background writes (for the writer thread)."""
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


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples of tensors and plain values) whose tensors no
    longer share memory with the live model or optimizer, on the CPU."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach()
        return obj.clone() if obj.device.type == "cpu" else obj.to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class BackgroundWriter:
    """One thread that writes checkpoint files while training goes on.

    At most one job is in flight: :meth:`submit` first waits for the previous one (memory stays
    bounded to one copy of the state, and a failed write is raised at the next save or at the
    end of training, with a note saying what was being written).
    """

    def __init__(self) -> None:
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> None:
        self.wait()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="basetrainer-ckpt")
            self._pending = self._executor.submit(job)

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


_WRITER = BackgroundWriter()
_IN_WRITER = threading.local()  # set in the writer thread: its own saves must not wait for it


def write_in_background(job: Callable[[], Any], what: str = "checkpoint") -> None:
    """Run ``job`` (which writes files from a :func:`snapshot`, with :func:`write_atomically`)
    in the checkpoint writer thread, after the writes asked for before it. Returns at once."""
    def run() -> None:
        _IN_WRITER.active = True
        try:
            job()
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"raised while writing {what} (in the background checkpoint writer)")
            raise

    _WRITER.submit(run)


def wait_for_writes() -> None:
    """Block until every background checkpoint write has finished; re-raise a failed one."""
    if not getattr(_IN_WRITER, "active", False):
        _WRITER.wait()


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
