"""WandbLogger: the figures LogHistory logs, the config and the best model, in a Weights & Biases
run (see :mod:`basetrainer.callbacks.trackers` for the rules every tracker follows)."""
import logging
import os
from typing import Any, Dict, List, Optional

from basetrainer.callbacks import reachability
from basetrainer.callbacks.trackers import Tracker, import_tracker_package, require
from basetrainer.runtime.deadline import check_seconds

_logger = logging.getLogger(__name__)


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
        timeout: seconds the W&B server may take to answer the probe of its address, made
            before ``wandb.init`` (online only) so that a dead server costs that, not the
            deadline.
        deadline: seconds one call (``wandb.init``, an epoch's log, an upload, ``finish``) may
            take in all; default: the config's ``tracker_deadline`` (60 s). W&B is told it too
            (its ``init_timeout`` and ``finish_timeout``), so that it gives up by itself and
            its exit hook does not wait longer.

    Raises:
        ImportError: wandb is not installed (``pip install "basetrainer[wandb]"``).
        ValueError: ``timeout`` or ``deadline`` is not a positive number.
    """

    name = "wandb"

    def __init__(self, project: Optional[str] = None, entity: Optional[str] = None, name: Optional[str] = None,
                 dir: Optional[str] = None, mode: Optional[str] = None, tags: Optional[List[str]] = None,
                 log_best_model: bool = True, timeout: float = 5.0, deadline: Optional[float] = None) -> None:
        super().__init__(deadline)
        require("wandb", "wandb", "loggers: wandb (WandbLogger)")
        self.timeout = check_seconds(timeout, "timeout", 5)
        self.project = project
        self.entity = entity
        self.run_name = name
        self.dir = dir
        self.mode = mode
        self.tags = list(tags) if tags else None
        self.log_best_model = log_best_model
        self.run: Any = None
        self._next_step = 0    # W&B takes rows at this step or later

    def _import(self) -> None:
        import_tracker_package("wandb", "wandb", "loggers: wandb (WandbLogger)")

    def _start(self, start_epoch: int) -> None:
        import wandb

        folder = os.path.abspath(self.dir) if self.dir else self.folder()
        os.makedirs(folder, exist_ok=True)
        config = self.config()
        self.run_id = self.run_id or "".join(ch for ch in str(self.job).lower() if ch.isalnum())[-32:]
        server = self._server(wandb)
        if server is not None:   # online: before wandb.init's minutes of waiting for a dead server
            reachability.probe(server, self.timeout, "the W&B server")
        self.run = run = wandb.init(project=self.project or os.environ.get("WANDB_PROJECT") or "basetrainer",
                                    entity=self.entity, name=self.run_name or os.path.basename(self.folder()),
                                    dir=folder, mode=self.mode, tags=self.tags, id=self.run_id, resume="allow",
                                    reinit="create_new", settings=self._settings(wandb))
        self._next_step = int(getattr(run, "step", 0) or 0)    # a resumed online run: past its last row
        run.config.update(config, allow_val_change=True)   # a key changed on resume takes its new value
        run.define_metric("global_step")
        run.define_metric("epoch")
        run.define_metric("train_step/*", step_metric="global_step")
        _logger.info("W&B: run %s in %s", self.run_id, folder)

    def _settings(self, wandb: Any) -> Any:
        """W&B's settings of the run: no console capture, no system stats, and W&B's own waits
        (for ``wandb.init``, and for the uploads of ``finish`` and of its exit hook) no longer
        than the deadline (where this W&B version has them)."""
        deadline = self.call_deadline()
        known = getattr(wandb.Settings, "model_fields", {})
        bounds = {k: deadline for k in ("init_timeout", "finish_timeout") if k in known}
        return wandb.Settings(console="off", x_disable_stats=True, **bounds)

    def _server(self, wandb: Any) -> Optional[str]:
        """The W&B server this run would talk to (``WANDB_BASE_URL``, else W&B's settings
        file, else its default), or None when it talks to none (offline, disabled)."""
        settings = wandb.Settings()
        try:   # as wandb.setup() reads them: the settings file, then the environment
            folder = os.environ.get("WANDB_CONFIG_DIR") or os.path.join("~", ".config", "wandb")
            settings.settings_system = os.path.join(os.path.expanduser(folder), "settings")
            settings.update_from_system_settings()
            settings.update_from_env_vars(os.environ.copy())
        except Exception:   # another wandb version: the environment and the defaults only
            pass
        mode = (self.mode or os.environ.get("WANDB_MODE") or getattr(settings, "mode", None) or "online").lower()
        if mode in ("offline", "dryrun", "disabled") or str(os.environ.get("WANDB_DISABLED", "")).lower() in (
                "true", "1", "yes"):
            return None
        return os.environ.get("WANDB_BASE_URL") or getattr(settings, "base_url", None)

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

    def _artifacts(self, paths: list, folder: str) -> None:
        import wandb

        artifact = wandb.Artifact(name=f"{(folder or 'files').replace('/', '-')}-{self.run_id}", type="evaluation")
        for path in paths:
            artifact.add_file(path, name=os.path.join(folder, os.path.basename(path)) if folder else None)
        self.run.log_artifact(artifact)

    def _finish(self, done: bool) -> None:
        import wandb

        if self.log_best_model:
            for path in self.best_files():
                artifact = wandb.Artifact(name=f"best-model-{self.run_id}", type="model")
                artifact.add_file(path)
                self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if done else 1)
        self.run = None
