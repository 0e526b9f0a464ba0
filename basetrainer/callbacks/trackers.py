"""Experiment trackers: MLflow and Weights & Biases receive exactly the figures LogHistory logs.

A tracker is a callback that :class:`~basetrainer.callbacks.log_history.LogHistory` forwards its
figures to: every epoch's row (``train/loss``, ``test/Accuracy``, ``lr``, ``epoch_time``; x = the
epoch) and the running train figures of every ``log_freq``-th step (``train_step/<name>``; x = the
global step, ``epoch * steps + batch + 1``), the same values, at the same moments, as TensorBoard
and history.csv get. Nothing is read from the device for a tracker.

Two ways to turn one on, with the same result:

- by name: ``loggers: [tensorboard, csv, mlflow]`` in the config, or
  ``LogHistory(..., loggers=["mlflow"])``: LogHistory builds, drives and checkpoints it;
- as an object in ``build_callbacks``: ``[..., LogHistory(...), MLflowLogger(uri=...)]``
  (a LogHistory must be in the list: it is what the tracker logs). ``MLflowLogger`` lives in
  :mod:`basetrainer.callbacks.mlflow_logger`, ``WandbLogger`` in
  :mod:`basetrainer.callbacks.wandb_logger`; this module holds what they share.

The rules every tracker follows:

- only the main process talks to the tracker (one run per job, never one per rank);
- ``import basetrainer`` never imports mlflow or wandb; a tracker that is asked for while its
  package is missing is an error at once, naming the ``pip install`` command;
- a resumed run (``resume: auto``) continues the same tracker run: its id is part of the
  callback's checkpointed state (and, for a run killed before its first checkpoint, found again
  by basetrainer's run id);
- every epoch's figures appear once. A tracker's history only grows, so what a killed run
  logged after its last checkpoint cannot be taken back: on resume, a figure is logged only
  at an x beyond the last one the run already holds for it. The epochs trained again after a
  resume therefore keep the figures the killed run logged for them, which a resume makes equal
  (it is exact), except ``epoch_time``. A resumed tracker also sends the epoch rows of the
  checkpoint's history that the run lacks (a killed W&B process loses what it had not yet
  written to disk);
- a tracker that fails while training (store unreachable, disk full, an error in a log call)
  logs one warning and stops logging; training goes on. A server that does not answer costs
  seconds, not minutes: it is asked once (``HEAD /``) with a short timeout before the tracker's
  client is handed it (:mod:`basetrainer.callbacks.reachability`), and MLflow's requests are
  bounded (``timeout``) for the whole run.
"""
import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import uuid
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple, Type

from basetrainer.callbacks.callbacks import Callback
from basetrainer.runtime import atomic
from basetrainer.runtime.checkpoint import plain
from basetrainer.runtime.errors import MissingExtraError

_logger = logging.getLogger(__name__)


def require(module: str, extra: str, what: str) -> None:
    """Raise an ImportError naming the pip command when ``module`` cannot be imported (without
    importing it)."""
    missing = module in sys.modules and sys.modules[module] is None   # blocked (as tests do)
    if not missing:
        try:
            missing = importlib.util.find_spec(module) is None
        except (ImportError, ValueError):
            missing = True
    if missing:
        raise MissingExtraError(f"{what} needs the {module} package, which is not installed: "
                                f'pip install "basetrainer[{extra}]"')


def import_tracker_package(module: str, extra: str, what: str) -> Any:
    """Import ``module`` (a tracker's package); an ImportError names the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"{what} needs the {module} package ({e}): pip install \"basetrainer[{extra}]\"") from e


class Tracker(Callback):
    """Base class of the experiment trackers: LogHistory calls :meth:`log_epoch` and
    :meth:`log_step` on the main process; the tracker starts its run in ``on_train_begin`` and
    ends it in ``on_train_end``. A subclass implements the ``_start``, ``_epoch``, ``_step``,
    ``_finish`` hooks; every call to them is guarded: the first failure logs one warning and
    the tracker logs nothing more in that run.

    Args:
        name: the tracker's name in messages and in LogHistory's state.
    """

    name = "tracker"

    def __init__(self) -> None:
        super().__init__()
        self.run_id: Optional[str] = None
        self.job: Optional[str] = None   # basetrainer's run id that ``run_id`` belongs to
        self.log_history: Any = None     # the LogHistory whose figures this tracker gets
        self.failed = False
        self._active = False

    # ------------------------------------------------------------------ wiring
    def attach(self, log_history: Any) -> None:
        """Called by the LogHistory that forwards its figures here."""
        self.log_history = log_history

    def state_dict(self) -> Dict[str, Any]:
        return {"run_id": self.run_id, "job": self.job}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run_id = state.get("run_id") or self.run_id
        self.job = state.get("job") or self.job

    def _guard(self, action: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; the first failure turns this tracker off with one warning."""
        if self.failed:
            return None
        try:
            with self._calls():
                return fn()
        except Exception as e:
            self.failed = True
            self._active = False
            _logger.warning("%s: %s failed (%s: %s); it logs nothing more in this run, training goes on",
                            type(self).__name__, action, type(e).__name__, e)
            return None

    def _calls(self) -> ContextManager[Any]:
        """The context every call to the hooks runs in (a subclass may bound its client's
        requests there); none by default."""
        return contextlib.nullcontext()

    def config(self) -> Dict[str, Any]:
        """The trainer's config as plain values (what a tracker records as the run's parameters)."""
        cfg = getattr(self.trainer, "cfg", None)
        if cfg is None:
            return {}
        items = vars(cfg) if hasattr(cfg, "__dict__") and not isinstance(cfg, dict) else dict(cfg)
        return {str(k): plain(v) for k, v in items.items()}

    def folder(self) -> str:
        """Where a local store goes: the config's ``work_dir``, else the folder above LogHistory's
        ``log_dir``, else the current folder."""
        cfg = getattr(self.trainer, "cfg", None)
        work_dir = cfg.get("work_dir") if hasattr(cfg, "get") else None
        if work_dir:
            return os.path.abspath(work_dir)
        if self.log_history is not None:
            return os.path.dirname(os.path.abspath(self.log_history.log_dir))
        return os.path.abspath(".")

    def job_id(self) -> str:
        """basetrainer's id of this run (kept across resumes by the run folder), or a new one."""
        return str(getattr(self.trainer, "run_id", None) or uuid.uuid4().hex)

    def best_files(self) -> List[str]:
        """The best weights files of the trainer's ModelCheckpoints (complete on disk once
        :meth:`on_train_end` has waited for the background writes)."""
        found = []
        from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

        for cb in getattr(self.trainer, "callbacks", None) or []:
            path = cb.best_file if isinstance(cb, ModelCheckpoint) else None
            if isinstance(path, str) and os.path.isfile(path):
                found.append(path)
        return found

    # ------------------------------------------------------------------ events
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.log_history is None:
            raise ValueError(f"{type(self).__name__} logs what LogHistory logs, and the callbacks hold no "
                             f"LogHistory: add LogHistory(log_dir, log_freq) to build_callbacks")
        self.failed, self._active = False, False
        if not self.is_main_process:
            return
        start = int(getattr(self.trainer, "start_epoch", 0) or 0)
        job = self.job_id()
        if self.job is not None and self.job != job:   # a new run from another run's checkpoint
            self.run_id = None
        self.job = job
        self._guard("starting the run", lambda: self._start(start))
        self._active = not self.failed
        if start and self._active:   # resumed: the epochs before it, where the run lacks them
            for row in self.log_history.rows:
                epoch = int(row.get("epoch", 0))
                if epoch < start:
                    figures = {k: v for k, v in row.items() if k != "epoch"}
                    self.log_epoch(epoch, figures, self.log_history.steps_before(epoch + 1))

    def log_epoch(self, epoch: int, figures: Dict[str, float], global_step: int) -> None:
        """An epoch's row (LogHistory's ``on_epoch_end``), x = ``epoch``."""
        if self._active and self.is_main_process:
            self._guard(f"logging epoch {epoch}", lambda: self._epoch(epoch, figures, global_step))

    def log_step(self, global_step: int, figures: Dict[str, float]) -> None:
        """The running train figures of a ``log_freq`` step, x = ``global_step``."""
        if self._active and self.is_main_process:
            self._guard(f"logging step {global_step}", lambda: self._step(global_step, figures))

    def log_artifacts(self, paths: List[str], folder: str = "") -> None:
        """Files (e.g. an evaluation report and its PNGs) as artifacts of the run, under ``folder``."""
        if self._active and self.is_main_process and paths:
            self._guard(f"logging {len(paths)} artifact(s)", lambda: self._artifacts(list(paths), folder))

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        if not (self._active and self.is_main_process):
            return
        trainer = self.trainer
        done = bool(getattr(trainer, "stop_training", False)) or (
            getattr(trainer, "phase", "") == "end" and int(getattr(trainer, "epoch", 0)) + 1 >= int(
                getattr(trainer, "num_epochs", 0)))
        try:   # the best weights file is complete once the background writes are
            atomic.wait_for_writes()
        except Exception:   # a failed checkpoint write: raised (never hidden in a tracker warning)
            self._guard("ending the run", lambda: self._finish(False))
            self._active = False
            raise
        self._guard("ending the run", lambda: self._finish(done))
        self._active = False

    # ------------------------------------------------------------------ hooks
    def _start(self, start_epoch: int) -> None:
        raise NotImplementedError

    def _epoch(self, epoch: int, figures: Dict[str, float], global_step: int) -> None:
        raise NotImplementedError

    def _step(self, global_step: int, figures: Dict[str, float]) -> None:
        raise NotImplementedError

    def _finish(self, done: bool) -> None:
        raise NotImplementedError

    def _artifacts(self, paths: List[str], folder: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not log artifacts")


# name -> (module, class): each tracker in its own module, imported when asked for
TRACKERS: Dict[str, Tuple[str, str]] = {"mlflow": ("basetrainer.callbacks.mlflow_logger", "MLflowLogger"),
                                        "wandb": ("basetrainer.callbacks.wandb_logger", "WandbLogger")}


def tracker_class(name: str) -> Type[Tracker]:
    """The tracker class of a ``loggers`` name (``mlflow``, ``wandb``)."""
    module, cls = TRACKERS[name]
    return getattr(importlib.import_module(module), cls)


def build_trackers(names: List[str]) -> Tuple[List[Tracker], bool, bool]:
    """The trackers named in ``names`` (a ``loggers`` list), and whether TensorBoard and
    history.csv are asked for.

    Raises:
        ValueError: an unknown name (the valid ones are listed).
        ImportError: a tracker's package is missing (the pip command is named).
    """
    from basetrainer.utils.setup_config import parse_loggers

    names = parse_loggers(list(names))
    return [tracker_class(n)() for n in names if n in TRACKERS], "tensorboard" in names, "csv" in names
