"""Console/file log lines, TensorBoard scalars, history.csv and a PNG of the curves."""
import csv
import glob
import io
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Union

from basetrainer.callbacks import trackers as tracking
from basetrainer.callbacks.callbacks import Callback, batch_size_of
from basetrainer.runtime import atomic, comm
from basetrainer.utils import log

_logger = logging.getLogger(__name__)


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class LogHistory(Callback):
    """Logs training as it goes (main process only).

    - every ``log_freq`` steps one line: epoch, step/steps, the running train figures, lr,
      samples/s and ETA; the same figures as TensorBoard scalars ``train_step/<name>``;
    - at each epoch end one line with every figure, TensorBoard scalars under their ``logs``
      keys (``train/loss``, ``test/Accuracy``, ``lr``, x = epoch), and a row of
      ``<log_dir>/history.csv``; besides the ``logs`` figures the row holds ``epoch_time``
      (seconds) and the data-stall meter of the epoch's training
      (:mod:`basetrainer.engine.data_wait`): ``data_wait``, the largest share of the train phase
      a rank spent waiting for its loader, ``data_wait_mean`` (over the ranks) and
      ``data_wait_rank`` (the rank of the largest); the line ends ``| data wait 21% (max rank
      1: 41%)``. Being timings, they are not in ``logs`` nor in ``run()``'s History;
    - at train end ``<log_dir>/history.png`` (loss, accuracy and LR curves) when matplotlib
      is installed.

    Everything continues across a resume: the rows of history.csv are part of the checkpoint
    (epochs after it, written by the killed run, are dropped and trained again), and
    TensorBoard is told to purge the events written after the checkpoint (``purge_step``), so
    each epoch appears once. Step scalars go to ``<log_dir>/steps`` (their own x axis).

    Experiment trackers (MLflow, Weights & Biases; :mod:`basetrainer.callbacks.trackers`) get
    every figure it logs, at the same moments and x: the epoch rows and the step figures.

    Args:
        log_dir: folder for TensorBoard events, history.csv and history.png.
        log_freq: steps between lines (also how often recorders publish running figures).
        logger: where lines go (default: this module's logger). When the program configured no
            logging at all (no handler on the way to the root logger), the run sets up
            basetrainer's console log (:func:`basetrainer.utils.log.set_logger`, INFO, stdout),
            so progress is printed without any setup: a line every ``log_freq`` steps and one
            per epoch.
        indicators: figure names to show in step lines (default: all).
        is_main_process: write anything at all (default: rank 0 only).
        tensorboard: write TensorBoard events.
        loggers: where the figures go: names from ``tensorboard``, ``csv`` (history.csv),
            ``mlflow``, ``wandb`` (trackers built with their defaults) and tracker objects
            (``MLflowLogger(uri=...)``). Default (None): the trainer's config key ``loggers``
            (default ``[tensorboard, csv]``). Trackers listed among the trainer's callbacks get
            the figures too.

    Raises:
        ValueError: a bad ``log_freq`` or an unknown logger name.
        ImportError: a named tracker's package is missing (the pip command is named).
    """

    def __init__(self, log_dir: str, log_freq: int = 50, logger: Optional[logging.Logger] = None,
                 indicators: Optional[Sequence[str]] = None, is_main_process: Optional[bool] = None,
                 tensorboard: bool = True, loggers: Optional[Sequence[Union[str, "tracking.Tracker"]]] = None) -> None:
        super().__init__()
        if not isinstance(log_freq, int) or log_freq <= 0:
            raise ValueError(f"log_freq={log_freq!r} must be a positive integer")
        self.log_dir = log_dir
        self.log_freq = log_freq
        self.logger = logger or _logger
        self.indicators = list(indicators) if indicators else None
        if is_main_process is not None:
            self.is_main_process = is_main_process
        self.tensorboard = tensorboard
        self.writer: Any = None
        self.rows: List[Dict[str, Any]] = []
        self._t_train = self._t_epoch = self._t_window = 0.0
        self._samples_window = 0
        self._steps_done = 0
        self.step_ends: Dict[int, int] = {}   # epoch -> x of its last step (steps taken since epoch 0)
        self._step_base = 0                   # x of the step before the current epoch's first
        self.step_writer: Any = None
        self.csv = True
        self.trackers: List[tracking.Tracker] = []   # built here from ``loggers`` (their state is ours)
        self.sinks: List[tracking.Tracker] = []      # those and the trainer's own tracker callbacks
        self._tracker_states: Dict[str, Any] = {}
        self._loggers_given = loggers is not None
        self._config_loggers: Optional[List[str]] = None
        self._tensorboard_arg = tensorboard
        if loggers is not None:
            self._set_loggers(loggers)

    def _set_loggers(self, loggers: Sequence[Union[str, "tracking.Tracker"]]) -> None:
        if isinstance(loggers, str):
            loggers = [loggers]
        names = [x for x in loggers if isinstance(x, str)]
        objects = [x for x in loggers if not isinstance(x, str)]
        for x in objects:
            if not isinstance(x, tracking.Tracker):
                raise TypeError(f"LogHistory(loggers=...): {x!r} is neither a logger name nor a Tracker "
                                f"(MLflowLogger, WandbLogger)")
        built, tensorboard, csv_on = tracking.build_trackers(names)
        self.tensorboard = self._tensorboard_arg and tensorboard
        self.csv = csv_on
        self.trackers = built + objects
        override = self.__dict__.get("_is_main_process")
        for t in self.trackers:
            if override is not None and t.__dict__.get("_is_main_process") is None:
                t.is_main_process = override

    def set_trainer(self, trainer: Any) -> None:
        super().set_trainer(trainer)
        if not self._loggers_given:   # the config's loggers (a script that does not name them)
            cfg = getattr(trainer, "cfg", None)
            names = cfg.get("loggers") if hasattr(cfg, "get") else None
            if names is not None and list(names) != self._config_loggers:
                self._set_loggers(list(names))
                self._config_loggers = list(names)
        for t in self.trackers:
            t.set_trainer(trainer)
            if t.state_key in self._tracker_states:
                t.load_state_dict(self._tracker_states.pop(t.state_key))
        listed = [c for c in getattr(trainer, "callbacks", None) or [] if isinstance(c, tracking.Tracker)
                  and c not in self.trackers and c.log_history in (None, self)]
        self.sinks = self.trackers + listed
        for t in self.sinks:
            t.attach(self)

    @property
    def state_key(self) -> str:
        return f"LogHistory:{os.path.basename(os.path.normpath(self.log_dir))}"

    def run_folders(self) -> List[str]:
        return [self.log_dir]

    def run_files(self) -> List[str]:
        """history.csv, history.png and TensorBoard events in ``log_dir`` (an earlier run's, at start)."""
        names = [os.path.join(self.log_dir, n) for n in ("history.csv", "history.png")]
        events = glob.glob(os.path.join(self.log_dir, "**", "events.out.tfevents.*"), recursive=True)
        return sorted([p for p in names if os.path.exists(p)] + events)

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"rows": [dict(r) for r in self.rows], "step_ends": dict(self.step_ends)}
        if self.trackers:
            state["trackers"] = {t.state_key: t.state_dict() for t in self.trackers}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rows = [dict(r) for r in state.get("rows") or []]
        self.step_ends = {int(k): int(v) for k, v in (state.get("step_ends") or {}).items()}
        self._tracker_states = dict(state.get("trackers") or {})
        for t in self.trackers:
            if t.state_key in self._tracker_states:
                t.load_state_dict(self._tracker_states.pop(t.state_key))

    # ---------------------------------------------------------------- helpers
    def _shown(self, logs: dict, phase: str) -> Dict[str, float]:
        out = {}
        for key, value in logs.items():
            if not key.startswith(phase + "/") or not isinstance(value, float):
                continue
            name = key.split("/", 1)[1]
            if self.indicators is None or any(name.startswith(i) for i in self.indicators):
                out[name] = value
        return out

    def steps_before(self, epoch: int) -> int:
        """Train steps taken before ``epoch`` began: the x axis of step scalars and trackers.

        Counted as the run went, so a resume with another batch size goes on after the steps
        of the epochs before it. A checkpoint without the count (2.0's) gives the trainer's
        ``global_step`` at an epoch's end without gradient accumulation, else
        ``epoch * steps an epoch``.
        """
        if epoch - 1 in self.step_ends:
            return self.step_ends[epoch - 1]
        return epoch * self._epoch_steps()

    def _epoch_steps(self) -> int:
        loader = getattr(self.trainer, "train_loader", None)
        return len(loader) if loader is not None else 1

    def _open_writer(self, epoch: int, step: int) -> None:
        """TensorBoard writers whose events from ``epoch`` / ``step`` on replace older ones."""
        if not self.tensorboard:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is a dependency, but keep training if it is broken
            self.logger.warning("TensorBoard unavailable (%s): no event files are written", e)
            return
        epochs_before = glob.glob(os.path.join(self.log_dir, "events.out.tfevents.*"))
        steps_dir = os.path.join(self.log_dir, "steps")
        steps_before = glob.glob(os.path.join(steps_dir, "events.out.tfevents.*"))
        # TensorBoard reads a folder's event files in name order, and a name starts with its
        # second: a file from the same second (an earlier run() of this process) could sort
        # after the new one ("....11" < "....9") and its events would win over the purge
        stamp = f"{int(time.time()):010d}"
        if any(os.path.basename(p).split(".")[3] == stamp for p in epochs_before + steps_before):
            time.sleep(max(0.0, int(stamp) + 1 - time.time()))
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=epoch if epochs_before else None)
        self.step_writer = SummaryWriter(log_dir=steps_dir, purge_step=step if steps_before else None)

    # ---------------------------------------------------------------- events
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.trainer is not None:
            self.trainer.log_freq = self.log_freq
        if self.is_main_process and self.logger.name.split(".")[0] == log.ROOT and not self.logger.hasHandlers():
            log.set_logger("info")   # the program set up no logging: its lines would go nowhere; print them
        self._t_train = time.perf_counter()
        self._steps_done = 0
        start = getattr(self.trainer, "start_epoch", 0)
        self.rows = [r for r in self.rows if r.get("epoch", 0) < start]   # a resume keeps the epochs before it
        self.step_ends = {e: x for e, x in self.step_ends.items() if e < start}
        trainer = self.trainer
        if start and not self.step_ends and not getattr(trainer, "batch_in_epoch", 0) and getattr(
                trainer, "accumulate_steps", 1) == 1 and getattr(trainer, "global_step", 0):
            self.step_ends[start - 1] = int(trainer.global_step)   # a checkpoint without the count (2.0)
        self._step_base = self.steps_before(start)
        done = start >= int(getattr(trainer, "num_epochs", start + 1))   # a finished run: nothing follows
        if self.is_main_process and (start or getattr(trainer, "batch_in_epoch", 0)) and not done:
            self.logger.info("resumed at epoch %d, step %d of it (global step %d): lines above about later steps "
                             "came from the interrupted run and are done again below", start,
                             getattr(trainer, "batch_in_epoch", 0), getattr(trainer, "global_step", 0))
        if self.is_main_process:
            os.makedirs(self.log_dir, exist_ok=True)
            self._open_writer(start, self._step_base + getattr(self.trainer, "batch_in_epoch", 0) + 1)
        for t in self.trackers:   # the trainer calls its own tracker callbacks itself
            t.on_train_begin(logs)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._t_epoch = self._t_window = time.perf_counter()
        self._samples_window = 0
        self._step_base = self.steps_before(epoch)

    def on_train_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                         logs: Optional[dict] = None) -> None:
        self._samples_window += batch_size_of(inputs)

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self._steps_done += 1
        if not self.is_main_process or (batch + 1) % self.log_freq:
            return
        logs = logs or {}
        trainer = self.trainer
        now = time.perf_counter()
        rate = self._samples_window * comm.get_world_size() / max(now - self._t_window, 1e-9)
        self._t_window, self._samples_window = now, 0
        steps = len(trainer.train_loader)
        total = (trainer.num_epochs - trainer.start_epoch) * steps
        eta = (now - self._t_train) / max(self._steps_done, 1) * (total - self._steps_done)
        figures = self._shown(logs, "train")
        text = " ".join(f"{k}: {v:.4f}" for k, v in figures.items())
        lr = logs.get("lr")
        self.logger.info("epoch %d/%d step %d/%d %s%s | %.1f samples/s | ETA %s", trainer.epoch,
                         trainer.num_epochs, batch + 1, steps, text, f" lr: {lr:.6g}" if lr is not None else "",
                         rate, _fmt_time(eta))
        step = self._step_base + batch + 1
        scalars = {f"train_step/{name}": value for name, value in figures.items()}
        if lr is not None:
            scalars["train_step/lr"] = lr
        if self.step_writer is not None:
            for name, value in scalars.items():
                self.step_writer.add_scalar(name, value, step)
        for t in self.sinks:
            t.log_step(step, scalars)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.step_ends[epoch] = self._step_base + self._epoch_steps()
        if not self.is_main_process:
            return
        logs = logs or {}
        seconds = time.perf_counter() - self._t_epoch
        row: Dict[str, Any] = {"epoch": epoch}
        row.update({k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        row["epoch_time"] = seconds
        meter = getattr(self.trainer, "data_wait", None)   # the engine's data-stall meter of this epoch's training
        waits = meter.figures() if meter is not None and meter.epoch == epoch else {}
        row.update(waits)
        self.rows.append(row)
        text = " ".join(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}"
                        for k, v in row.items() if k != "epoch" and k not in waits)
        if waits:
            text += f" | {meter.text()}"
        self.logger.info("epoch %d/%d done: %s", epoch, self.trainer.num_epochs if self.trainer else -1, text)
        if self.writer is not None:
            for key, value in row.items():
                if key != "epoch":
                    self.writer.add_scalar(key, value, epoch)
            self.writer.flush()
        if self.csv:
            self._write_csv()
        figures = {k: v for k, v in row.items() if k != "epoch"}
        for t in self.sinks:
            t.log_epoch(epoch, figures, self.step_ends[epoch])

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        for writer in (self.writer, self.step_writer):
            if writer is not None:
                writer.close()
        self.writer = self.step_writer = None
        try:
            if self.is_main_process and self.rows:
                self.plot()
        finally:
            for t in self.trackers:
                t.on_train_end(logs)

    # ---------------------------------------------------------------- files
    def _write_csv(self) -> None:
        keys: List[str] = []
        for row in self.rows:
            keys += [k for k in row if k not in keys]
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=keys)
        writer.writeheader()
        writer.writerows(self.rows)
        atomic.write_atomically(text.getvalue(), os.path.join(self.log_dir, "history.csv"))

    def plot(self) -> Optional[str]:
        """Draw loss, accuracy-like and LR curves to ``<log_dir>/history.png`` (needs matplotlib)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.logger.debug("matplotlib not installed: no history.png")
            return None
        keys = [k for k in self.rows[-1] if "/" in k]
        groups = {"loss": [k for k in keys if "loss" in k.lower()],
                  "metrics": [k for k in keys if "loss" not in k.lower()],
                  "lr": ["lr"] if "lr" in self.rows[-1] else []}
        groups = {k: v for k, v in groups.items() if v}
        if not groups:   # no recorder and no LR schedule: no curve to draw
            return None
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.6), squeeze=False)
        for ax, (title, names) in zip(axes[0], groups.items()):
            for name in names:
                points = [(r["epoch"], r[name]) for r in self.rows if name in r]
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
            ax.set_title(title)
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=100)
        plt.close(fig)
        return atomic.write_atomically(image.getvalue(), os.path.join(self.log_dir, "history.png"))
