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
  bounded (``timeout``) for the whole run;
- every call to the client runs in order on the tracker's own daemon thread within a wall-clock
  deadline (``deadline``, else the config's ``tracker_deadline``; :mod:`basetrainer.runtime.deadline`):
  the start, an epoch's log (so that it is stored before the epoch's checkpoint), uploads and the
  end are waited for at most that long; the ``log_freq`` steps' logs are queued. A call past it
  turns the tracker off with one warning naming the call, the deadline and the key to raise;
  training goes on, and the stuck call never holds the process's exit.
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
from basetrainer.runtime.deadline import CallFailed, DeadlineExceeded, Worker, check_seconds
from basetrainer.utils.setup_config import ENGINE_KEYS
from basetrainer.runtime.errors import MissingExtraError

_logger = logging.getLogger(__name__)

DEFAULT_DEADLINE = float(ENGINE_KEYS["tracker_deadline"][0])   # seconds one tracker call may take


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
    ``_finish`` hooks; every call to them is guarded: they run in order on the tracker's own
    thread, each within the deadline, and the first failure or overrun logs one warning and the
    tracker logs nothing more in that run.

    Args:
        deadline: seconds one call (starting the run, an epoch's log, an upload, ending the
            run) may take; default: the config's ``tracker_deadline`` (60 s).

    Raises:
        ValueError: ``deadline`` is not a positive number.
    """

    name = "tracker"   # the tracker's name in messages and in LogHistory's state

    def __init__(self, deadline: Optional[float] = None) -> None:
        super().__init__()
        self.deadline = None if deadline is None else check_seconds(deadline, "deadline", DEFAULT_DEADLINE)
        self.run_id: Optional[str] = None
        self.job: Optional[str] = None   # basetrainer's run id that ``run_id`` belongs to
        self.log_history: Any = None     # the LogHistory whose figures this tracker gets
        self.failed = False
        self._active = False
        self._worker: Optional[Worker] = None   # this run's thread for the client's calls

    # ------------------------------------------------------------------ wiring
    def attach(self, log_history: Any) -> None:
        """Called by the LogHistory that forwards its figures here."""
        self.log_history = log_history

    def state_dict(self) -> Dict[str, Any]:
        return {"run_id": self.run_id, "job": self.job}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run_id = state.get("run_id") or self.run_id
        self.job = state.get("job") or self.job

    def _guard(self, action: str, fn: Callable[[], Any], wait: bool = True) -> Any:
        """Run ``fn`` on this tracker's thread, and wait for it (at most the deadline once it
        runs), or with ``wait=False`` queue it and return; the first failure or overrun turns
        this tracker off with one warning."""
        if self.failed or self._worker is None:
            return None

        def bounded() -> Any:
            with self._calls():
                return fn()

        try:
            if wait:
                return self._worker.call(action, bounded)
            self._worker.post(action, bounded)
        except DeadlineExceeded as e:
            where = (f"{type(self).__name__}(deadline=...)" if self.deadline is not None
                     else "the config key tracker_deadline")
            self._turn_off(f"{e.what} did not finish within its deadline of {e.deadline:g} s (a server that "
                           f"answers too slowly, or not at all); to wait longer raise {where}, to go without "
                           f"it remove {self.name!r} from loggers (or the {type(self).__name__} from your callbacks)")
        except CallFailed as e:
            self._turn_off(f"{e.what} failed ({type(e.error).__name__}: {e.error})")
        except Exception as e:
            self._turn_off(f"{action} failed ({type(e).__name__}: {e})")
        return None

    def _turn_off(self, why: str) -> None:
        self.failed = True
        self._active = False
        if self._worker is not None:
            self._worker.close()   # a call past its deadline stays on the daemon thread, given up
            self._worker = None
        _logger.warning("%s: %s; it logs nothing more in this run, training goes on", type(self).__name__, why)

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
        self._worker = Worker(f"basetrainer-{self.name}", self.call_deadline())
        try:   # here: an import talks to no server, and a first import's seconds are not the server's
            self._import()
        except Exception as e:
            self._turn_off(f"starting the run failed ({type(e).__name__}: {e})")
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
            self._guard(f"logging step {global_step}", lambda: self._step(global_step, figures), wait=False)

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
            self._end(False)
            raise
        self._end(done)

    def _end(self, done: bool) -> None:
        self._guard("ending the run", lambda: self._finish(done))   # after the queued logs
        self._active = False
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def call_deadline(self) -> float:
        """Seconds one call may take: ``deadline``, else the config's ``tracker_deadline``."""
        if self.deadline is not None:
            return self.deadline
        cfg = getattr(self.trainer, "cfg", None)
        value = cfg.get("tracker_deadline") if hasattr(cfg, "get") else None
        return DEFAULT_DEADLINE if value is None else check_seconds(value, "tracker_deadline", DEFAULT_DEADLINE)

    # ------------------------------------------------------------------ hooks
    def _import(self) -> None:
        """Import the client's package (on the calling thread, before the deadline's clock)."""

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
