"""The run's checkpoints: what a resume needs, and how it is written, found, validated and loaded.

This module is their one home. A checkpoint is a dict of tensors, numbers, strings, lists and
dicts only, so it loads with ``torch.load(..., weights_only=True)``: a file that carries pickled
code is refused. A run's folder holds ``last.pth`` (the newest resumable state) and
``last.prev.pth`` (the one before, kept as a fallback); :class:`CheckpointFolder` writes the
files a save asks for (best and per-epoch weights) *before* ``last.pth``, and deletes superseded
files only after it, so no crash loses a file that ``last.pth`` refers to.
"""
import collections
import logging
import os
import random
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from basetrainer.runtime import atomic, shard_folders
from basetrainer.runtime.errors import CheckpointError
from basetrainer.runtime.safe_load import crc_errors, load_file, non_finite  # noqa: F401 (their names here too)

logger = logging.getLogger(__name__)

FORMAT = "basetrainer-checkpoint-1"
LAST, PREVIOUS = "last.pth", "last.prev.pth"
DAMAGED = ".damaged"   # a last.pth that did not load, set aside beside the fallback (with its shards)


# ----------------------------------------------------------------------------- loading
def extract_state_dict(obj: Any, source: str = "checkpoint") -> Dict[str, torch.Tensor]:
    """The model weights inside a loaded file (a state_dict, or a checkpoint's ``model`` or
    ``state_dict`` entry), without a DataParallel/DDP ``module.`` prefix."""
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    elif isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        if isinstance(obj, dict) and any(isinstance(v, str) and v.startswith(shard_folders.MARKER) for v in obj.values()):
            raise CheckpointError(f"{source} is a sharded checkpoint's last.pth (its tensors are in its shard "
                                  f"folder): load a best/per-epoch weights file, or make one file of it with "
                                  f"python -m basetrainer.runtime.sharded <its last.pth> <out.pth>")
        raise CheckpointError(f"{source} does not hold a model state_dict (a dict of tensors): give a file "
                              f"written by torch.save(model.state_dict()) or a basetrainer checkpoint")
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def is_resumable(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("format") == FORMAT


# ----------------------------------------------------------------------------- random generators
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


# ----------------------------------------------------------------------------- the config of a run
IDENTITY_KEYS = ("net_type", "input_size", "train_data", "test_data", "seed", "num_classes", "classes")
QUIET_KEYS = ("resume", "overwrite", "config_file", "progress")


def plain(value: Any) -> Any:
    """``value`` in weights-only types (dicts, lists, numbers, strings); other objects as text."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# what torch.load(weights_only=True) takes back, by exact type (numpy's float64 is a float, yet
# pickles as numpy's: a subclass is refused too)
_LOADABLE_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.dtype,
                    torch.device)
_LOADABLE_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set)


def unloadable(value: Any, where: str = "") -> Optional[str]:
    """Where in ``value`` something is that a weights-only load refuses (``"['hist'] is a
    numpy.ndarray"``), or None: everything is tensors, numbers, strings, lists, tuples, sets or
    dicts of them."""
    if isinstance(value, torch.Tensor):
        return None
    kind = type(value)
    if kind in _LOADABLE_LEAVES:
        return None
    if kind in _LOADABLE_CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and (type(key) not in _LOADABLE_LEAVES + (tuple,) or unloadable(key)):
                return f"{where or 'the state'} has a key of type {type(key).__module__}.{type(key).__qualname__}"
            found = unloadable(item, f"{where}[{key!r}]" if not isinstance(value, set) else f"{where}{{...}}")
            if found:
                return found
        return None
    return f"{where or 'the state'} is a {kind.__module__}.{kind.__qualname__}"


def config_changes(saved: Dict[str, Any], current: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for every key that differs (quiet keys left out)."""
    saved, current = plain(saved or {}), plain(current or {})
    missing = object()
    out = []
    for key in sorted(set(saved) | set(current)):
        if key in QUIET_KEYS:
            continue
        old, new = saved.get(key, missing), current.get(key, missing)
        if isinstance(old, str) and isinstance(new, str) and old and new and os.path.normpath(old) == os.path.normpath(new):
            continue   # the same path written another way (a trailing slash)
        if old != new:
            out.append((key, None if old is missing else old, None if new is missing else new))
    return out


# ----------------------------------------------------------------------------- the state of a run
def position(state: dict) -> Tuple[int, str, int]:
    """``(epoch, phase, batch)`` of a checkpoint (2.0 files have no phase)."""
    phase = state.get("phase") or ("end" if state.get("epoch_complete", True) else "train")
    return int(state["epoch"]), phase, int(state.get("batch", 0))


def describe(state: dict) -> str:
    epoch, phase, batch = position(state)
    return {"end": f"end of epoch {epoch}", "test": f"epoch {epoch} before its test phase",
            "train": f"epoch {epoch} after step {batch}"}[phase]


# ----------------------------------------------------------------------------- the folder
class CheckpointFolder:
    """The checkpoint folder of a run: ``last.pth``, ``last.prev.pth`` and the files saves stage.

    A save (:meth:`commit`) writes, in this order: every staged file (e.g. best and per-epoch
    weights, :meth:`stage`), then ``last.pth`` (the old one becomes ``last.prev.pth``), then
    runs the staged clean-ups (deleting superseded files). In the background writer thread
    when asked, else before it returns.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.last = os.path.join(folder, LAST)
        self.previous = os.path.join(folder, PREVIOUS)
        self._writes: List[Callable[[dict], None]] = []
        self._cleanups: List[Callable[[], None]] = []
        self._foreground = False
        self.committed: Optional[str] = None    # what the newest last.pth of this process holds
        self._last_damaged = False              # last.pth did not load: never rotate it over last.prev.pth

    # ------------------------------------------------------------------ finding
    def recover(self) -> Optional[str]:
        """A writer killed between keeping the previous ``last.pth`` and putting the new one in
        place (rename fallback) leaves ``last.pth`` missing and the new one complete in its temp
        file: put it in place. Returns the recovered path, or None."""
        if os.path.exists(self.last):
            return None
        for temp in atomic.stale_temps(self.folder):
            if not os.path.basename(temp).startswith(f".{LAST}.tmp"):
                continue
            try:
                state = load_file(temp)
            except ValueError:
                continue
            if is_resumable(state) and not non_finite(state.get("model", {})):
                os.replace(temp, self.last)
                atomic.fsync_folder(self.folder)
                logger.warning("recovered %s from the complete file a killed write left (%s)", self.last,
                               describe(state))
                return self.last
        return None

    def find_resumable(self) -> Optional[Tuple[str, dict]]:
        """``(path, state)`` of the newest loadable checkpoint (``last.pth``, else
        ``last.prev.pth``, with a warning), or None when the folder holds neither.

        Raises:
            ValueError: checkpoints exist but none is loadable; the message names each and why.
        """
        damaged: List[str] = []
        if os.path.exists(self.previous) and not os.path.exists(self.last):
            damaged.append(f"{self.last!r} is missing")
        for path in (self.last, self.previous):
            if not os.path.exists(path):
                continue
            try:
                state = load_file(path)
                if not is_resumable(state):
                    raise ValueError(f"{path!r} is not a resumable checkpoint")
                bad = non_finite(state.get("model", {}))
                if bad:
                    raise ValueError(f"{path!r} holds non-finite weights ({', '.join(bad[:3])})")
                if state.get("shards"):
                    shard_folders.check(state, self.folder)
            except ValueError as e:
                damaged.append(str(e))
                self._last_damaged = self._last_damaged or path == self.last
                continue
            if damaged:
                logger.warning("resume: %s; resuming from %s (%s) instead", "; ".join(damaged), path,
                               describe(state))
            return path, state
        if damaged:
            raise CheckpointError(f"resume='auto': no loadable checkpoint is left in {self.folder}: "
                                  + "; ".join(damaged) + ". Nothing was trained over it. Put a good copy back, "
                                  "or start a new run: another work_dir, or overwrite: true (moves this run aside)")
        return None

    # ------------------------------------------------------------------ writing
    def stage(self, write: Callable[[dict], None], cleanup: Optional[Callable[[], None]] = None,
              background: bool = True) -> None:
        """Have the next :meth:`commit` run ``write(state)`` before it writes ``last.pth`` and
        ``cleanup()`` after. ``state`` is the state being saved (its ``"model"`` entry: the
        trainer's weights, a copy when written in the background). ``background=False`` makes
        that commit write before it returns."""
        self._writes.append(write)
        if cleanup is not None:
            self._cleanups.append(cleanup)
        self._foreground = self._foreground or not background

    def discard_staged(self) -> None:
        """Forget what saves staged (a save that is refused writes none of it)."""
        self._writes, self._cleanups, self._foreground = [], [], False

    @property
    def has_staged(self) -> bool:
        return bool(self._writes or self._cleanups)

    def commit(self, state: dict, background: bool = True, path: Optional[str] = None,
               weights: Optional[Dict[str, torch.Tensor]] = None) -> str:
        """Write the staged files, then ``state`` as ``last.pth`` (or ``path``), then clean up.

        ``weights``: the whole model's weights for the staged files when ``state["model"]`` does
        not hold them (a sharded checkpoint's, gathered on the main process).

        Raises:
            FloatingPointError: the weights hold NaN or inf (nothing is written).
            DiskFullError: no space; the message says what of the previous save is intact.
        """
        bad = non_finite(state["model"])
        if bad:
            self.discard_staged()
            raise FloatingPointError(f"refusing to save {describe(state)}: non-finite weights in "
                                     f"{', '.join(bad[:5])}; the previous checkpoint in {self.folder} is kept")
        writes, cleanups = self._writes, self._cleanups
        background = background and not self._foreground
        self._writes, self._cleanups, self._foreground = [], [], False
        target = path or self.last
        what = describe(state)

        keep = self.previous if target == self.last else None
        if keep and self._last_damaged:   # set the damaged last.pth aside: last.prev.pth is the good one
            self._last_damaged, keep = False, None
            if os.path.exists(self.last):
                damaged = atomic.set_aside(self.last, DAMAGED)   # never over an earlier one
                shards = shard_folders.referenced(self.folder, (os.path.basename(damaged),))
                logger.warning("moved the damaged %s to %s%s; %s stays", self.last, damaged,
                               f" (its shards stay in {shards[0]})" if shards else "", self.previous)
                if not shards and shard_folders.has_shard_folders(self.folder):
                    logger.warning("%s cannot be read, so which shard folder is its is unknown: the next save "
                                   "removes the shard folders no readable checkpoint refers to", damaged)

        def job(saved: dict) -> None:
            try:
                for write in writes:
                    write(saved if weights is None else {**saved, "model": weights})
                atomic.write_atomically(saved, target, keep_previous=keep)
            except atomic.DiskFullError as e:
                raise atomic.DiskFullError(e.errno, f"{e.strerror}. {self.intact()}") from None
            if target == self.last:
                self.committed = what
            for cleanup in cleanups:
                cleanup()
            if target == self.last and (saved.get("shards") or shard_folders.has_shard_folders(self.folder)):
                # shard folders no last refers to any more (also after a switch from fsdp to ddp)
                # (a damaged last.pth set aside keeps its shards: the evidence, and the other ranks' good ones)
                shard_folders.remove_unreferenced(self.folder, shard_folders.referenced(self.folder, (LAST, PREVIOUS)
                                                                            + self.damaged_files()))

        if background:
            copy = atomic.snapshot(state)
            atomic.write_in_background(lambda: job(copy), what=f"the checkpoint of {what} in {self.folder}")
        else:
            atomic.wait_for_writes()
            job(state)
        return target

    def damaged_files(self) -> Tuple[str, ...]:
        """The damaged ``last.pth`` files set aside (``last.pth.damaged``, ``.damaged.2``, ...)."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return ()
        return tuple(sorted(n for n in names if n == LAST + DAMAGED or n.startswith(LAST + DAMAGED + ".")))

    def intact(self) -> str:
        """What of the previous save is whole (said when a save fails for lack of space)."""
        if os.path.exists(self.last):
            held = self.committed
            if held is None:   # written by an earlier run of this folder
                try:
                    held = describe(load_file(self.last))
                except (OSError, ValueError, KeyError, TypeError):
                    held = None
            held = f" ({held})" if held else ""
            return (f"The previous {LAST} in {self.folder} is intact{held}: free some space (or move "
                    f"work_dir) and continue with resume: auto")
        return f"No {LAST} had been written to {self.folder} yet"
