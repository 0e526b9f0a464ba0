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
  (a LogHistory must be in the list: it is what the tracker logs).

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
  logs one warning and stops logging; training goes on.
"""
import importlib
import importlib.util
import logging
import os
import sys
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from basetrainer.callbacks.callbacks import Callback
from basetrainer.runtime import atomic
from basetrainer.runtime.checkpoint import QUIET_KEYS, plain

_logger = logging.getLogger(__name__)

_MAX_PARAM = 6000      # MLflow's limit on a parameter's value (characters)


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
        raise ImportError(f"{what} needs the {module} package, which is not installed: "
                          f'pip install "basetrainer[{extra}]"')


def _import(module: str, extra: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs the {module} package ({e}): pip install \"basetrainer[{extra}]\"") from e


def _value_text(value: Any) -> str:
    return str(plain(value))


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
            return fn()
        except Exception as e:
            self.failed = True
            self._active = False
            _logger.warning("%s: %s failed (%s: %s); it logs nothing more in this run, training goes on",
                            type(self).__name__, action, type(e).__name__, e)
            return None

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
        for cb in getattr(self.trainer, "callbacks", None) or []:
            path = getattr(cb, "best_file", None)
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
            steps = self.steps_per_epoch()
            for row in getattr(self.log_history, "rows", None) or []:
                epoch = int(row.get("epoch", 0))
                if epoch < start:
                    figures = {k: v for k, v in row.items() if k != "epoch"}
                    self.log_epoch(epoch, figures, (epoch + 1) * steps)

    def steps_per_epoch(self) -> int:
        loader = getattr(self.trainer, "train_loader", None)
        return len(loader) if loader is not None else 1

    def log_epoch(self, epoch: int, figures: Dict[str, float], global_step: int) -> None:
        """An epoch's row (LogHistory's ``on_epoch_end``), x = ``epoch``."""
        if self._active and self.is_main_process:
            self._guard(f"logging epoch {epoch}", lambda: self._epoch(epoch, figures, global_step))

    def log_step(self, global_step: int, figures: Dict[str, float]) -> None:
        """The running train figures of a ``log_freq`` step, x = ``global_step``."""
        if self._active and self.is_main_process:
            self._guard(f"logging step {global_step}", lambda: self._step(global_step, figures))

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


class MLflowLogger(Tracker):
    """Logs to MLflow: the config as parameters, every figure LogHistory logs as a metric (epoch
    figures at step = epoch, step figures ``train_step/<name>`` at step = global step), and at
    the end the best weights file of each ModelCheckpoint as an artifact (``best_model/``).

    The store is ``uri``, else the config's ``mlflow_uri``, else
    ``sqlite:///<work_dir>/mlflow.db`` with artifacts in ``<work_dir>/mlflow-artifacts`` (see it
    with ``mlflow ui --backend-store-uri sqlite:///<work_dir>/mlflow.db``). A resumed run
    continues the same MLflow run; a config key changed on resume cannot change its parameter
    (MLflow's parameters are immutable): it is recorded as the tag
    ``config_changed.<key>`` = ``"<new> (was <old>, from epoch <n>)"``.

    Args:
        uri: the tracking URI (``sqlite:///...``, ``http://host:5000``, ``databricks``, ...).
        experiment: the experiment's name (default: ``basetrainer``).
        run_name: the run's name (default: the name of ``work_dir``).
        log_best_model: log the best weights as an artifact at the end.

    Raises:
        ImportError: mlflow is not installed (``pip install "basetrainer[mlflow]"``).

    Example::

        callbacks = [LossesRecorder(), LogHistory(log_dir, log_freq=50),
                     MLflowLogger(uri="http://127.0.0.1:5000", experiment="digits")]
    """

    name = "mlflow"

    def __init__(self, uri: Optional[str] = None, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 log_best_model: bool = True) -> None:
        super().__init__()
        require("mlflow", "mlflow", "loggers: mlflow (MLflowLogger)")
        self.uri = uri
        self.experiment = experiment
        self.run_name = run_name
        self.log_best_model = log_best_model
        self.client: Any = None
        self._logged: Dict[str, int] = {}    # resumed run: metric -> last step it holds

    def tracking_uri(self) -> str:
        cfg = getattr(self.trainer, "cfg", None)
        uri = self.uri or (cfg.get("mlflow_uri") if hasattr(cfg, "get") else None)
        return uri or "sqlite:///" + os.path.join(self.folder(), "mlflow.db")

    def _start(self, start_epoch: int) -> None:
        _import("mlflow", "mlflow", "loggers: mlflow (MLflowLogger)")
        from mlflow.entities import Param, RunStatus, RunTag
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri()
        if uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
        self.client = client = MlflowClient(tracking_uri=uri)
        params = {k: _value_text(v)[:_MAX_PARAM] for k, v in self.config().items()}
        job = str(self.job)
        if self.run_id is None:   # killed before its first checkpoint: find the run by basetrainer's id
            found = self._find_run(job)
            self.run_id = found
        run = self._get_run(self.run_id) if self.run_id is not None else None
        if self.run_id is not None and run is None:
            _logger.warning("MLflow: the store %s does not hold run %s (mlflow_uri changed?): starting a new run",
                            uri, self.run_id)
            self.run_id = None
        if run is not None:
            self._resume(run, params, start_epoch)
            client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            _logger.info("MLflow: continuing run %s at %s", self.run_id, uri)
            return
        name = self.experiment or "basetrainer"
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            location = None
            if uri.startswith("sqlite:///"):   # artifacts beside the local store (not in the current folder)
                location = "file://" + os.path.join(os.path.dirname(os.path.abspath(uri[len("sqlite:///"):])),
                                                    "mlflow-artifacts")
            experiment_id = client.create_experiment(name, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        run_name = self.run_name or os.path.basename(self.folder()) or None
        run = client.create_run(experiment_id, run_name=run_name, tags={"basetrainer.run_id": job})
        self.run_id = run.info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):       # MLflow takes at most 100 parameters per call
            client.log_batch(self.run_id, params=items[i:i + 100])
        client.log_batch(self.run_id, tags=[RunTag("basetrainer.log_dir", os.path.abspath(self.log_history.log_dir))])
        _logger.info("MLflow: run %s at %s", self.run_id, uri)

    def _get_run(self, run_id: str) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException as e:
            if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def _find_run(self, job: str) -> Optional[str]:
        experiment = self.client.get_experiment_by_name(self.experiment or "basetrainer")
        if experiment is None:
            return None
        runs = self.client.search_runs([experiment.experiment_id],
                                       filter_string=f"tags.`basetrainer.run_id` = '{job}'", max_results=1)
        return runs[0].info.run_id if runs else None

    def _resume(self, run: Any, params: Dict[str, str], start_epoch: int) -> None:
        from mlflow.entities import Param, RunTag

        client = self.client
        self._logged = {}
        for key in run.data.metrics:   # the last step of each metric this run holds already
            history = client.get_metric_history(self.run_id, key)
            self._logged[key] = max(m.step for m in history) if history else -1
        old = run.data.params
        new_params, tags = [], []
        for key, value in params.items():
            if key not in old:
                new_params.append(Param(key, value))
            elif old[key] != value and key not in QUIET_KEYS:
                tags.append(RunTag(f"config_changed.{key}", f"{value} (was {old[key]}, from epoch {start_epoch})"[:5000]))
        for i in range(0, len(new_params), 100):
            client.log_batch(self.run_id, params=new_params[i:i + 100])
        if tags:
            client.log_batch(self.run_id, tags=tags)

    def _log(self, figures: Dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in figures.items() if step > self._logged.get(k, -1)]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def _epoch(self, epoch: int, figures: Dict[str, float], global_step: int) -> None:
        self._log(figures, epoch)

    def _step(self, global_step: int, figures: Dict[str, float]) -> None:
        self._log(figures, global_step)

    def _finish(self, done: bool) -> None:
        from mlflow.entities import RunStatus

        if self.log_best_model:
            for path in self.best_files():
                self.client.log_artifact(self.run_id, path, artifact_path="best_model")
        self.client.set_terminated(self.run_id, status=RunStatus.to_string(
            RunStatus.FINISHED if done else RunStatus.FAILED))


class WandbLogger(Tracker):
    """Logs to Weights & Biases: the config as the run's config, every figure LogHistory logs
    (one history row per x: step rows ``train_step/<name>`` with ``global_step``, epoch rows with
    ``epoch``, each figure plotted against its own x, W&B's ``_step`` = the global step), and at
    the end the best weights file of each ModelCheckpoint as a ``model`` artifact.

    ``WANDB_MODE=offline`` (or ``mode="offline"``) needs no account and no network: the run is
    written under ``<dir>/wandb/offline-run-*`` and uploaded later with ``wandb sync``. A resumed
    run continues the same W&B run (``id`` + ``resume="allow"``); a config key changed on resume
    updates the run's config (``allow_val_change``). W&B's history steps only go forward, so rows
    at a step the run already holds are not sent again (online; offline, ``wandb sync`` of the
    killed and the resumed folder keeps the first). A SIGKILLed process loses the rows W&B had
    not written yet; the resumed run sends the epoch rows of its checkpoint again, so that
    each epoch is there once (the step rows of the lost stretch stay lost).

    Args:
        project: the W&B project (default: ``$WANDB_PROJECT``, else ``basetrainer``).
        entity: the W&B entity (team or user).
        name: the run's display name (default: the name of ``work_dir``).
        dir: the folder for W&B's files (default: ``work_dir``).
        mode: ``online``, ``offline`` or ``disabled`` (default: ``$WANDB_MODE``, else W&B's).
        tags: tags of the run.
        log_best_model: log the best weights as an artifact at the end.

    Raises:
        ImportError: wandb is not installed (``pip install "basetrainer[wandb]"``).
    """

    name = "wandb"

    def __init__(self, project: Optional[str] = None, entity: Optional[str] = None, name: Optional[str] = None,
                 dir: Optional[str] = None, mode: Optional[str] = None, tags: Optional[List[str]] = None,
                 log_best_model: bool = True) -> None:
        super().__init__()
        require("wandb", "wandb", "loggers: wandb (WandbLogger)")
        self.project = project
        self.entity = entity
        self.run_name = name
        self.dir = dir
        self.mode = mode
        self.tags = list(tags) if tags else None
        self.log_best_model = log_best_model
        self.run: Any = None
        self._next_step = 0    # W&B takes rows at this step or later

    def _start(self, start_epoch: int) -> None:
        wandb = _import("wandb", "wandb", "loggers: wandb (WandbLogger)")
        folder = os.path.abspath(self.dir) if self.dir else self.folder()
        os.makedirs(folder, exist_ok=True)
        config = self.config()
        self.run_id = self.run_id or "".join(ch for ch in str(self.job).lower() if ch.isalnum())[-32:]
        self.run = run = wandb.init(project=self.project or os.environ.get("WANDB_PROJECT") or "basetrainer",
                                    entity=self.entity, name=self.run_name or os.path.basename(self.folder()),
                                    dir=folder, mode=self.mode, tags=self.tags, id=self.run_id, resume="allow",
                                    reinit="create_new", settings=wandb.Settings(console="off", x_disable_stats=True))
        self._next_step = int(getattr(run, "step", 0) or 0)    # a resumed online run: past its last row
        run.config.update(config, allow_val_change=True)   # a key changed on resume takes its new value
        run.define_metric("global_step")
        run.define_metric("epoch")
        run.define_metric("train_step/*", step_metric="global_step")
        _logger.info("W&B: run %s in %s", self.run_id, folder)

    def _row(self, row: Dict[str, Any], step: int) -> None:
        if step < self._next_step:
            return
        for key in row:
            if key not in ("epoch", "global_step") and not key.startswith("train_step/"):
                self._define(key)
        self.run.log(row, step=step)

    def _define(self, key: str) -> None:
        defined = self.__dict__.setdefault("_defined", set())
        if key not in defined:
            self.run.define_metric(key, step_metric="epoch")
            defined.add(key)

    def _epoch(self, epoch: int, figures: Dict[str, float], global_step: int) -> None:
        self._row({"epoch": epoch, **figures}, global_step)

    def _step(self, global_step: int, figures: Dict[str, float]) -> None:
        self._row({"global_step": global_step, **figures}, global_step)

    def _finish(self, done: bool) -> None:
        import wandb

        if self.log_best_model:
            for path in self.best_files():
                artifact = wandb.Artifact(name=f"best-model-{self.run_id}", type="model")
                artifact.add_file(path)
                self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if done else 1)
        self.run = None


TRACKERS: Dict[str, Callable[[], Tracker]] = {"mlflow": MLflowLogger, "wandb": WandbLogger}


def build_trackers(names: List[str]) -> Tuple[List[Tracker], bool, bool]:
    """The trackers named in ``names`` (a ``loggers`` list), and whether TensorBoard and
    history.csv are asked for.

    Raises:
        ValueError: an unknown name (the valid ones are listed).
        ImportError: a tracker's package is missing (the pip command is named).
    """
    from basetrainer.utils.setup_config import parse_loggers

    names = parse_loggers(list(names))
    return [TRACKERS[n]() for n in names if n in TRACKERS], "tensorboard" in names, "csv" in names
