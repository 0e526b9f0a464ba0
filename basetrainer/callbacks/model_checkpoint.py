"""Saving the model: the latest resumable state, the best weights, and per-epoch weights."""
import glob
import logging
import os
from typing import Any, Dict, Optional

import torch

from basetrainer.callbacks.callbacks import Callback, infer_mode, resolve_indicator
from basetrainer.engine import checkpoint, comm
from basetrainer.engine.engine import unwrap_model

_logger = logging.getLogger(__name__)


class ModelCheckpoint(Callback):
    """Writes, at each epoch end (main process only, every file atomically):

    - ``last.pth``: everything a resume needs (model, optimizer, scaler, epoch, step, callback
      states, RNG states, config); ``resume: auto`` picks it up;
    - ``best_model_<epoch>_<value>.pth``: the weights (an unwrapped ``state_dict``) of the best
      epoch by ``indicator`` (the previous best file is removed);
    - ``model_<epoch>_<value>.pth``: the weights of each epoch from ``start_save`` on; with
      ``start_save`` None or -1 only the last ``keep`` epochs are kept, with 0 none are written.

    Args:
        model: the model (wrappers are looked through); default the trainer's.
        optimizer: the optimizer (saved in ``last.pth``); default the trainer's.
        moder_dir: the folder (the original project's spelling; ``model_dir`` is accepted too).
        epochs: total epochs (informational; kept for compatibility).
        start_save: see above.
        indicator: the figure that decides "best" (``"Accuracy"`` = ``test/Accuracy`` when there
            is a test loader); "" keeps no best file.
        logger: where "saved ..." lines go.
        mode: ``"max"`` or ``"min"``; inferred from the name when omitted (``loss``/``err`` ->
            min). ``inverse=True`` (the original's keyword) means ``"min"``.
        keep: how many per-epoch files to keep when ``start_save`` is None or -1.
        save_freq_steps: also write ``last.pth`` every this many steps, mid-epoch (0 = off); a
            resume then continues inside the epoch, skipping the batches already trained.
        async_save: copy the state to CPU memory (a few ms) and write the files in a background
            thread while training goes on (default); they are complete when training ends (and
            before any later checkpoint is written); the copy is freed once written. ``False``
            writes them before ``on_epoch_end`` returns, with no copy. A failed background
            write is raised at the next save or at the end of training.

    Example::

        ModelCheckpoint(model=self.model, optimizer=self.optimizer, model_dir="work/model",
                        epochs=cfg.num_epochs, indicator="Accuracy")
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 moder_dir: Optional[str] = None, epochs: Optional[int] = None, start_save: Optional[int] = None,
                 indicator: str = "", logger: Optional[logging.Logger] = None, model_dir: Optional[str] = None,
                 mode: Optional[str] = None, inverse: Optional[bool] = None, keep: int = 10,
                 best_save: int = -1, save_freq_steps: int = 0, async_save: bool = True,
                 **kwargs: Any) -> None:
        super().__init__()
        folder = model_dir or moder_dir
        if not folder:
            raise ValueError("ModelCheckpoint needs model_dir (or moder_dir): the folder for .pth files")
        if mode is None:
            mode = "min" if inverse else infer_mode(indicator or "")
        if mode not in ("max", "min"):
            raise ValueError(f"mode={mode!r} must be 'max' or 'min'")
        if start_save is not None and (not isinstance(start_save, int) or start_save < -1):
            raise ValueError(f"start_save={start_save!r} must be None, -1 (keep the last {keep}), 0 (none) "
                             f"or the first epoch to save")
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
        self.best: Optional[float] = None
        self.best_epoch: Optional[int] = None
        self.best_file: Optional[str] = None
        if not isinstance(save_freq_steps, int) or save_freq_steps < 0:
            raise ValueError(f"save_freq_steps={save_freq_steps!r} must be an integer >= 0 (0 = only at epoch ends)")
        self.save_freq_steps = save_freq_steps
        self.async_save = bool(async_save)

    @property
    def moder_dir(self) -> str:  # the original project's attribute name
        return self.model_dir

    def _weights(self) -> Dict[str, torch.Tensor]:
        model = self._model if self._model is not None else self.trainer.model
        return unwrap_model(model).state_dict()

    def _improved(self, value: float) -> bool:
        if value != value:  # NaN never improves
            return False
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

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
        improved = value is not None and epoch >= self.best_save and self._improved(value)
        if improved:
            self.best, self.best_epoch = value, epoch
        rngs = comm.all_gather_object(checkpoint.rng_state())  # on every rank: it is a collective
        if not self.is_main_process:
            return
        os.makedirs(self.model_dir, exist_ok=True)
        suffix = f"_{value:.4f}" if value is not None else ""
        epoch_file = best_file = None
        if self.start_save != 0 and epoch >= max(self.start_save, 0):
            epoch_file = os.path.join(self.model_dir, f"model_{epoch:03d}{suffix}.pth")
        if improved:
            best_file = os.path.join(self.model_dir, f"best_model_{epoch:03d}{suffix}.pth")
            self.best_file = best_file
        state = self._last_state(epoch, rngs)
        shared = self._saves_trainer_model(state)   # last.pth's model is the weights files' model
        weights = None
        if epoch_file or best_file:
            weights = state["model"] if shared else self._weights()
        if self.async_save:  # copy now (training changes the tensors in place), write later
            # (a new copy each time, freed when written: keeping one to overwrite would save
            # ~20 ms per resnet18 epoch, but made every later step ~5% slower in the benchmark)
            state = checkpoint.snapshot(state)
            weights = state["model"] if shared and weights is not None else checkpoint.snapshot(weights)
            checkpoint.write_in_background(
                lambda: self._write_files(epoch, value, state, weights, epoch_file, best_file),
                what=f"epoch {epoch}'s checkpoints in {self.model_dir}")
        else:
            checkpoint.wait_for_writes()
            self._write_files(epoch, value, state, weights, epoch_file, best_file)

    def _saves_trainer_model(self, state: dict) -> bool:
        """Whether the weights files hold the same model as ``last.pth`` (then one state_dict,
        and one copy of it, serves both)."""
        if not isinstance(state.get("model"), dict) or self.trainer is None:
            return False
        return self._model is None or unwrap_model(self._model) is unwrap_model(self.trainer.model)

    def _write_files(self, epoch: int, value: Optional[float], state: dict, weights: Optional[dict],
                     epoch_file: Optional[str], best_file: Optional[str]) -> None:
        """Write ``last.pth``, the epoch's weights and the best weights (in the writer thread
        when ``async_save``)."""
        last = os.path.join(self.model_dir, "last.pth")
        checkpoint.write_atomically(state, last)
        self.logger.debug("saved %s (epoch %d)", last, epoch)
        if epoch_file is not None:
            checkpoint.write_atomically(weights, epoch_file)
        if best_file is not None:
            self._write_best(best_file, epoch_file, weights)
            for old in glob.glob(os.path.join(self.model_dir, "best_model_*.pth")):
                if os.path.abspath(old) != os.path.abspath(best_file):
                    os.remove(old)
            self.logger.info("saved best model (%s=%.4f, epoch %d): %s", self.indicator, value, epoch, best_file)
        if epoch_file is not None and self.start_save == -1:
            self._prune_epoch_files()

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.save_freq_steps and (batch + 1) % self.save_freq_steps == 0:
            self.trainer.save_checkpoint(os.path.join(self.model_dir, "last.pth"), background=self.async_save)

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        checkpoint.wait_for_writes()  # every file is complete when training returns

    def _write_best(self, path: str, epoch_file: Optional[str], weights: Optional[dict]) -> None:
        """The best weights: a hard link to this epoch's file when there is one (no second
        write of the same bytes), else a new file."""
        if os.path.exists(path):
            os.remove(path)
        try:
            if epoch_file is None:
                raise OSError("no per-epoch file to link")
            os.link(epoch_file, path)
        except OSError:
            checkpoint.write_atomically(weights, path)

    def _last_state(self, epoch: int, rngs: Optional[list] = None) -> dict:
        trainer = self.trainer
        if trainer is not None and hasattr(trainer, "state_dict"):
            return trainer.state_dict(rng=rngs)
        return {"format": checkpoint.FORMAT, "epoch": epoch, "model": self._weights(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else {}}

    def save_last(self, epoch: int, rngs: Optional[list] = None) -> str:
        """Write the resumable ``last.pth`` now (after any background write)."""
        path = os.path.join(self.model_dir, "last.pth")
        checkpoint.atomic_save(self._last_state(epoch, rngs), path)
        self.logger.debug("saved %s (epoch %d)", path, epoch)
        return path

    def _prune_epoch_files(self) -> None:
        files = sorted(glob.glob(os.path.join(self.model_dir, "model_[0-9][0-9][0-9]*.pth")))
        for old in files[:-self.keep] if self.keep > 0 else files:
            os.remove(old)

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best = state.get("best")
        self.best_epoch = state.get("best_epoch")
