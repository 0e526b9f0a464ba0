"""Saving the model: the latest resumable state, the best weights, and per-epoch weights."""
import glob
import logging
import math
import os
import re
from typing import Any, Dict, List, Optional

import torch

from basetrainer.callbacks.callbacks import Callback, infer_mode, mode_of_indicator, resolve_indicator
from basetrainer.runtime import atomic, checkpoint, run_folder
from basetrainer.runtime.modules import unwrap_model

_logger = logging.getLogger(__name__)


class ModelCheckpoint(Callback):
    """At each epoch end it asks the trainer for ``last.pth`` and writes (main process only,
    every file atomically, in the background writer thread unless ``async_save=False``):

    - ``best_model_<epoch>_<value>.pth``: the weights (an unwrapped ``state_dict``) of the best
      epoch by ``indicator``; a NaN or infinite figure is never best. A file holds the weights
      that gave the figure in its name: with ``ModelEMA(evaluate=True)`` a test figure is the
      average's, and so are the files' weights;
    - ``model_<epoch>_<value>.pth``: the weights of each epoch from ``start_save`` on; with
      ``start_save`` None or -1 only the last ``keep`` epochs are kept, with 0 none are written;
    - ``last.pth`` (written by the trainer once per save, however many ModelCheckpoints there
      are, after every callback's ``on_epoch_end``): everything a resume needs, and the
      previous one kept as ``last.prev.pth``.

    The weights files are on disk before ``last.pth`` records them, and a file is deleted only
    after ``last.pth`` stops referring to it, so no crash loses the best model. It only ever
    deletes files it wrote itself (its state remembers them across a resume); two
    ModelCheckpoints sharing a folder put their indicator in their file names
    (``best_model_<indicator>_...``).

    Args:
        model: the model whose weights files are written (wrappers are looked through);
            default the trainer's (``last.pth`` always holds the trainer's).
        optimizer: kept for compatibility (``last.pth`` holds the trainer's optimizer).
        moder_dir: the folder (the original project's spelling; ``model_dir`` is accepted too).
        epochs: total epochs (informational; kept for compatibility).
        start_save: see above.
        indicator: the figure that decides "best" (``"Accuracy"`` = ``test/Accuracy`` when there
            is a test loader); "" keeps no best file.
        logger: where "saved ..." lines go.
        mode: ``"max"`` or ``"min"``. When omitted, the recorder that writes the indicator
            decides at ``on_train_begin`` (a MetricRecorder's metric's ``higher_is_better``),
            else the name (``loss``/``err`` -> min). ``inverse=True`` (the original's keyword)
            means ``"min"``.
        keep: how many per-epoch files to keep when ``start_save`` is None or -1.
        save_freq_steps: also write ``last.pth`` every this many steps, mid-epoch (0 or None = off); a
            resume then continues inside the epoch, skipping the batches already trained.
        async_save: copy the state to CPU memory (a few ms) and write the files in a background
            thread while training goes on (default); they are complete when training ends (and
            before any later checkpoint is written). ``False`` writes them before the epoch
            ends. A failed background write is raised at the next save or at the end.

    Example::

        ModelCheckpoint(model=self.model, optimizer=self.optimizer, model_dir="work/model",
                        epochs=cfg.num_epochs, indicator="Accuracy")
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 moder_dir: Optional[str] = None, epochs: Optional[int] = None, start_save: Optional[int] = None,
                 indicator: str = "", logger: Optional[logging.Logger] = None, model_dir: Optional[str] = None,
                 mode: Optional[str] = None, inverse: Optional[bool] = None, keep: int = 10,
                 best_save: int = -1, save_freq_steps: Optional[int] = 0, async_save: bool = True,
                 **kwargs: Any) -> None:
        super().__init__()
        folder = model_dir or moder_dir
        if not folder:
            raise ValueError("ModelCheckpoint needs model_dir (or moder_dir): the folder for .pth files")
        self._mode_given = mode is not None or bool(inverse)
        if mode is None:
            mode = "min" if inverse else infer_mode(indicator or "")
        if mode not in ("max", "min"):
            raise ValueError(f"mode={mode!r} must be 'max' or 'min'")
        if start_save is not None and (not isinstance(start_save, int) or start_save < -1):
            raise ValueError(f"start_save={start_save!r} must be None, -1 (keep the last {keep}), 0 (none) "
                             f"or the first epoch to save")
        save_freq_steps = 0 if save_freq_steps is None else save_freq_steps   # None: off, as 0
        if not isinstance(save_freq_steps, int) or isinstance(save_freq_steps, bool) or save_freq_steps < 0:
            raise ValueError(f"save_freq_steps={save_freq_steps!r} must be an integer >= 0 (0 = only at epoch ends)")
        self._model = model
        self.optimizer = optimizer
        self.model_dir = folder
        self.epochs = epochs
        self.start_save = -1 if start_save is None else start_save
        self.indicator = indicator
        self.logger = logger or _logger
        self.mode = mode
        self.keep = int(kwargs.get("model_nums", keep))
        self.best_save = best_save if best_save is not None else -1
        self.save_freq_steps = save_freq_steps
        self.async_save = bool(async_save)
        self.best: Optional[float] = None
        self.best_epoch: Optional[int] = None
        self.best_file: Optional[str] = None
        self.epoch_files: List[str] = []     # per-epoch files written by this callback, oldest first
        self._superseded: List[str] = []     # files to delete once the next last.pth is written
        self._tag = ""

    @property
    def moder_dir(self) -> str:  # the original project's attribute name
        return self.model_dir

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint:{os.path.basename(os.path.normpath(self.model_dir))}:{self.indicator}"

    def last_checkpoint_dir(self) -> Optional[str]:
        return self.model_dir

    def run_folders(self) -> List[str]:
        return [self.model_dir]

    def run_files(self) -> List[str]:
        """The weights and checkpoint files in this callback's folder (an earlier run's, at start)."""
        return sorted(p for p in glob.glob(os.path.join(self.model_dir, "*.pth")))

    def _path(self, name: Optional[str]) -> Optional[str]:
        return os.path.join(self.model_dir, name) if name else None

    def _improved(self, value: float) -> bool:
        if not math.isfinite(value):  # NaN and inf are never best
            return False
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

    # ---------------------------------------------------------------- events
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if not self._mode_given:   # the recorder of the figure knows better than its name
            self.mode = mode_of_indicator(self.indicator, self.trainer) or infer_mode(self.indicator or "")
        sharing = [c for c in getattr(self.trainer, "callbacks", None) or []
                   if isinstance(c, ModelCheckpoint) and os.path.abspath(c.model_dir) == os.path.abspath(self.model_dir)]
        self._tag = ""
        if len(sharing) > 1:   # names that no other ModelCheckpoint of this folder writes
            name = "".join(ch if ch.isalnum() else "_" for ch in self.indicator or "weights")
            same = [c for c in sharing if c.indicator == self.indicator]
            self._tag = name if len(same) == 1 else f"{name}{same.index(self) + 1}"
        if self.is_main_process:
            if self.best_epoch is not None and self.best_file is None:  # a 2.0 checkpoint: find its best file
                found = glob.glob(os.path.join(self.model_dir, f"best_model_{self.best_epoch:03d}_*.pth"))
                self.best_file = found[0] if len(found) == 1 else None
            if self.best_file is not None and not os.path.exists(self.best_file):
                kept = self._set_aside_newer_files()
                self.logger.warning(
                    "the best weights so far (%s=%s, epoch %s, %s) are not in %s: the save after the checkpoint this "
                    "run resumed from removed them (resume fell back to %s), or that checkpoint comes from another "
                    "folder. %s; a new best file is written when an epoch beats %s=%s",
                    self.indicator, self.best, self.best_epoch, os.path.basename(self.best_file), self.model_dir,
                    checkpoint.PREVIOUS,
                    f"The files that save wrote for the epochs trained again are set aside, never overwritten or "
                    f"deleted: {', '.join(kept)}" if kept else "No later file of it is there", self.indicator, self.best)
            self._remove(self._superseded)  # left by a run killed after its last.pth was written
            self._superseded = []

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        logs = logs or {}
        value = None
        if self.indicator:
            key = resolve_indicator(self.indicator, self.trainer)
            if key not in logs:
                raise KeyError(f"ModelCheckpoint indicator {self.indicator!r} -> logs[{key!r}] is missing; "
                               f"figures present: {sorted(k for k in logs if '/' in k)}. Add the recorder "
                               f"that writes it, or change indicator")
            value = float(logs[key])
        tag = f"{self._tag}_" if self._tag else ""
        suffix = f"_{value:.4f}" if value is not None else ""
        epoch_file = best_file = None
        superseded: List[str] = []
        if self.start_save != 0 and epoch >= max(self.start_save, 0):
            epoch_file = os.path.join(self.model_dir, f"model_{tag}{epoch:03d}{suffix}.pth")
            self.epoch_files = [f for f in self.epoch_files if f != os.path.basename(epoch_file)]
            self.epoch_files.append(os.path.basename(epoch_file))
            if self.start_save == -1:
                cut = max(len(self.epoch_files) - self.keep, 0) if self.keep > 0 else len(self.epoch_files)
                superseded += self.epoch_files[:cut]
                self.epoch_files = self.epoch_files[cut:]
        if value is not None and epoch >= self.best_save and self._improved(value):
            best_file = os.path.join(self.model_dir, f"best_model_{tag}{epoch:03d}{suffix}.pth")
            if self.best_file and os.path.basename(self.best_file) != os.path.basename(best_file):
                superseded.append(os.path.basename(self.best_file))
            self.best, self.best_epoch, self.best_file = value, epoch, best_file
        self._superseded = superseded
        self.trainer.request_checkpoint(background=self.async_save)   # every rank: it gathers RNG states
        own = self._model is not None and unwrap_model(self._model) is not unwrap_model(self.trainer.model)
        evaluated = None   # every rank (a collective under fsdp): the weights the test figure is of
        if value is not None and not own and (epoch_file or best_file):
            evaluated = self._evaluated_weights(resolve_indicator(self.indicator, self.trainer))
        if not self.is_main_process or not (epoch_file or best_file or superseded):
            return
        weights = self._weights_copy() if own and (epoch_file or best_file) else None
        if evaluated is not None:
            weights = atomic.snapshot(evaluated) if self.async_save else evaluated
        whose = " (the ModelEMA average's weights)" if evaluated is not None else ""

        def write(state: dict) -> None:  # before last.pth (in the writer thread when async)
            self._write_files(state["model"] if weights is None else weights, epoch, value, epoch_file, best_file,
                              whose)

        self.trainer.checkpoint_folder().stage(write, cleanup=lambda: self._remove(superseded),
                                               background=self.async_save)

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.save_freq_steps and (batch + 1) % self.save_freq_steps == 0:   # after every callback's on_batch_end
            self.trainer.request_step_checkpoint(background=self.async_save)

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        try:
            atomic.wait_for_writes()  # every file is complete when training returns
        finally:
            if self.is_main_process:
                run_folder.mark_ended(self.model_dir)   # another process may resume it now

    # ---------------------------------------------------------------- files
    def _set_aside_newer_files(self) -> List[str]:
        """Rename this callback's weights files of the epochs this run trains again (written by a
        save newer than the checkpoint resumed from) to ``<name>.kept``: training them again
        would write over them, and a later cleanup delete them."""
        tag = re.escape(f"{self._tag}_" if self._tag else "")
        pattern = re.compile(rf"(best_model_|model_){tag}(\d{{3,}})(_[^_]*)?\.pth")
        kept = []
        for name in sorted(os.listdir(self.model_dir)) if os.path.isdir(self.model_dir) else []:
            match = pattern.fullmatch(name)
            if match and int(match.group(2)) >= getattr(self.trainer, "start_epoch", 0):
                kept.append(os.path.basename(atomic.set_aside(os.path.join(self.model_dir, name), ".kept")))
        return kept

    def _evaluated_weights(self, key: str) -> Optional[Dict[str, torch.Tensor]]:
        """The weights a test figure (``key``) was computed with when a callback swapped others
        in for the test phase (``ModelEMA(evaluate=True)``: its ``test_weights()``), so that a
        file holds what gave the figure in its name; None for the live weights. Every rank
        calls it (the average's shards are gathered under fsdp)."""
        if not key.startswith("test/"):
            return None   # a train figure is the live model's
        for cb in getattr(self.trainer, "callbacks", None) or []:
            weights = cb.test_weights() if cb is not None else None
            if weights is not None:
                return weights
        return None

    def _weights_copy(self) -> Dict[str, torch.Tensor]:
        weights = unwrap_model(self._model).state_dict()
        return atomic.snapshot(weights) if self.async_save else weights

    def _write_files(self, weights: Dict[str, torch.Tensor], epoch: int, value: Optional[float],
                     epoch_file: Optional[str], best_file: Optional[str], whose: str = "") -> None:
        if epoch_file is not None:
            atomic.write_atomically(weights, epoch_file)
        if best_file is not None:  # a hard link to this epoch's file when there is one
            if epoch_file is not None:
                atomic.link_atomically(epoch_file, best_file, content=weights)
            else:
                atomic.write_atomically(weights, best_file)
            self.logger.info("saved best model (%s=%.4f, epoch %d)%s: %s", self.indicator, value, epoch, whose,
                             best_file)

    def _remove(self, names: List[str]) -> None:
        """Delete files this callback wrote and no longer needs (never the current ones)."""
        keep = {os.path.basename(self.best_file or "")} | set(self.epoch_files)
        for name in names:
            if name in keep:
                continue
            try:
                os.remove(os.path.join(self.model_dir, name))
            except FileNotFoundError:
                pass

    def save_last(self, epoch: Optional[int] = None, rngs: Optional[list] = None) -> Optional[str]:
        """Write the resumable ``last.pth`` now (every rank calls it); returns its path."""
        return self.trainer.save_checkpoint()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch,
                "best_file": os.path.basename(self.best_file) if self.best_file else None,
                "epoch_files": list(self.epoch_files), "superseded": list(self._superseded)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best = state.get("best")
        self.best_epoch = state.get("best_epoch")
        self.best_file = self._path(state.get("best_file"))
        self.epoch_files = list(state.get("epoch_files") or [])
        self._superseded = list(state.get("superseded") or [])
