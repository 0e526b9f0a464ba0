"""MLflowLogger: the figures LogHistory logs, the config and the best model, in an MLflow run
(see :mod:`basetrainer.callbacks.trackers` for the rules every tracker follows)."""
import contextlib
import importlib.metadata
import logging
import math
import os
import time
import urllib.parse
from typing import Any, Dict, Iterator, Optional

from basetrainer.callbacks import reachability
from basetrainer.callbacks.trackers import Tracker, import_tracker_package, require
from basetrainer.runtime.checkpoint import QUIET_KEYS, plain
from basetrainer.runtime.deadline import check_seconds

_logger = logging.getLogger(__name__)

_MAX_PARAM = 6000      # MLflow's limit on a parameter's value (characters)


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

    A tracking server that does not answer costs at most about ``timeout`` seconds before the
    one warning: its address is probed first (a refused port fails at once; one that accepts
    and never answers after ``timeout``), and every request of the run is bounded (one retry,
    ``timeout`` seconds to answer; ``MLFLOW_HTTP_REQUEST_TIMEOUT``,
    ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`` set in the
    environment win). A URI MLflow has no store for (a mistyped scheme, a bad port) is an
    error when training starts, on every rank.

    Args:
        uri: the tracking URI (``sqlite:///...``, ``http://host:5000``, ``databricks``, ...).
        experiment: the experiment's name (default: ``basetrainer``).
        run_name: the run's name (default: the name of ``work_dir``).
        log_best_model: log the best weights as an artifact at the end.
        timeout: seconds the tracking server may take to answer (the probe, each request).
        deadline: seconds one call (starting the run, an epoch's log, an upload, ending the
            run) may take in all, however the server answers; default: the config's
            ``tracker_deadline`` (60 s).

    Raises:
        ImportError: mlflow is not installed (``pip install "basetrainer[mlflow]"``).
        ValueError: ``timeout`` or ``deadline`` is not a positive number; at
            ``on_train_begin``, a URI with a scheme MLflow has no store for.

    Example::

        callbacks = [LossesRecorder(), LogHistory(log_dir, log_freq=50),
                     MLflowLogger(uri="http://127.0.0.1:5000", experiment="digits")]
    """

    name = "mlflow"

    def __init__(self, uri: Optional[str] = None, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 log_best_model: bool = True, timeout: float = 5.0, deadline: Optional[float] = None) -> None:
        super().__init__(deadline)
        require("mlflow", "mlflow", "loggers: mlflow (MLflowLogger)")
        self.timeout = check_seconds(timeout, "timeout", 5)
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

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        check_uri(self.tracking_uri(), "uri" if self.uri else "mlflow_uri")   # every rank: bad input ends the job
        super().on_train_begin(logs)

    def _calls(self) -> Any:
        return _bounded_requests(self.timeout)

    def _import(self) -> None:
        import_tracker_package("mlflow", "mlflow", "loggers: mlflow (MLflowLogger)")
        import mlflow.entities  # noqa: F401
        import mlflow.tracking  # noqa: F401

    def _start(self, start_epoch: int) -> None:
        from mlflow.entities import Param, RunStatus, RunTag
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri()
        reachability.probe(uri, self.timeout, "the MLflow tracking server")   # before MLflow's minutes of retries
        if uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
        self.client = client = MlflowClient(tracking_uri=uri)
        params = {k: str(plain(v))[:_MAX_PARAM] for k, v in self.config().items()}
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
                text = f"{value} (was {old[key]}, from epoch {start_epoch})"
                tags.append(RunTag(f"config_changed.{key}", text[:5000]))
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

    def _artifacts(self, paths: list, folder: str) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, path, artifact_path=folder or None)

    def _finish(self, done: bool) -> None:
        from mlflow.entities import RunStatus

        if self.log_best_model:
            for path in self.best_files():
                self.client.log_artifact(self.run_id, path, artifact_path="best_model")
        self.client.set_terminated(self.run_id, status=RunStatus.to_string(
            RunStatus.FINISHED if done else RunStatus.FAILED))


# the schemes of MLflow's own stores (plugins add theirs through the "mlflow.tracking_store" entry points)
_SCHEMES = ("", "file", "http", "https", "databricks", "databricks-uc", "uc")
_DATABASES = ("postgresql", "mysql", "sqlite", "mssql")


def check_uri(uri: str, key: str) -> None:
    """Refuse a tracking URI MLflow has no store for, or a server address that cannot be one,
    without importing mlflow or touching the network.

    Raises:
        ValueError: naming ``key``, the URI and the forms MLflow takes.
    """
    forms = ("http(s)://host:port (a tracking server), sqlite:///path/mlflow.db, file:///folder, "
             "postgresql://..., databricks; or leave it out for sqlite:///<work_dir>/mlflow.db")
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"{key}={uri!r}: a tracking URI is a non-empty string: {forms}")
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()
    known = (scheme in _SCHEMES or len(scheme) == 1   # a Windows drive: a local path
             or any(scheme.startswith(db) for db in _DATABASES) or scheme in _plugin_schemes())
    if not known:
        raise ValueError(f"{key}={uri!r}: MLflow has no store for the scheme {scheme!r}; use {forms}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"{key}={uri!r}: the port is not a number in 1..65535 (write scheme://host:port)") from None
    if scheme in ("http", "https") and not parts.hostname:
        raise ValueError(f"{key}={uri!r} names no host (write {scheme}://host:port)")


def _plugin_schemes() -> set:
    try:
        return {ep.name for ep in importlib.metadata.entry_points(group="mlflow.tracking_store")}
    except Exception:   # a broken distribution's metadata: MLflow itself will tell
        return set()


@contextlib.contextmanager
def _bounded_requests(timeout: float) -> Iterator[None]:
    """MLflow's HTTP requests bounded for the calls inside: ``timeout`` seconds to answer, one
    retry after 1 s of back-off (MLflow's defaults: 120 s, 7 retries, back-off factor 2:
    minutes for a server that is down). A value the user set in the environment wins."""
    bounds = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(timeout))),
              "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    added = [name for name in bounds if name not in os.environ]
    for name in added:
        os.environ[name] = bounds[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
