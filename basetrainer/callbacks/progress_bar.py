"""tqdm progress bars for the train and test phases (main process only), shown only where a
person watches: a terminal or a Jupyter notebook."""
import logging
import sys
from typing import Any, Optional, TextIO

from basetrainer.callbacks.callbacks import Callback

_logger = logging.getLogger(__name__)


def _in_notebook() -> bool:
    """Whether this process is a Jupyter (IPython kernel) process. IPython is not imported
    here: a notebook has imported it already."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def is_interactive(stream: Optional[TextIO] = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``, where tqdm writes) is shown to a person as it
    changes: a terminal, or a notebook's output. A file, a pipe (CI logs, ``nohup``, SLURM output
    files) or a closed stream is not."""
    stream = sys.stderr if stream is None else stream
    try:
        if stream is not None and stream.isatty():
            return True
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False
    return _in_notebook()


class ProgressBar(Callback):
    """One bar per phase. The engine adds it when ``progress`` is on, in the main process.

    A bar redraws itself with carriage returns, which a file keeps as hundreds of overwritten
    copies, so by default the bars are drawn only when their stream (stderr) is a terminal or
    the process is a Jupyter kernel, decided when training begins; elsewhere LogHistory's line
    every ``log_freq`` steps is the progress report. The bar shows the figures the recorders
    publish every ``log_freq`` steps; it reads no tensor.

    Args:
        enabled: ``None`` (default) decides as above; ``True`` always draws, ``False`` never.
        file: the stream to draw on (default ``sys.stderr`` at the time training begins).

    Example::

        callbacks.append(ProgressBar(enabled=True))   # bars also in a log file
    """

    def __init__(self, enabled: Optional[bool] = None, file: Optional[TextIO] = None) -> None:
        super().__init__()
        self.enabled = enabled
        self.file = file
        self._show: Optional[bool] = None  # decided at on_train_begin (or first use)
        self._bar: Any = None

    def _stream(self) -> TextIO:
        return self.file if self.file is not None else sys.stderr

    def _decide(self) -> bool:
        if self.enabled is not None:
            return bool(self.enabled)
        shown = is_interactive(self._stream())
        if not shown:
            _logger.debug("progress bars off: stderr is neither a terminal nor a notebook "
                          "(LogHistory reports every log_freq steps)")
        return shown

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self._show = self._decide()

    def _open(self, total: Optional[int], desc: str) -> None:
        self._close()
        if self._show is None:
            self._show = self._decide()
        if not self._show:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False, file=self._stream())

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        loader = self.trainer.train_loader
        if loader is not None:
            self._open(len(loader), f"Train epoch {epoch}")

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if self.trainer.should_log(batch) and logs:
            shown = {k.split("/", 1)[1]: v for k, v in logs.items()
                     if k.startswith("train/") and isinstance(v, float)}
            if "lr" in logs:
                shown["lr"] = logs["lr"]
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        self._close()
        loader = self.trainer.test_loader
        if loader is not None:
            self._open(_batches(loader), f"Test  epoch {self.trainer.epoch}")

    def on_test_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                        logs: Optional[dict] = None) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def on_test_end(self, logs: Optional[dict] = None) -> None:
        self._close()

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        self._close()
        self._show = None


def _batches(loader: Any) -> Optional[int]:
    """``len(loader)``, or None (a bar without a total) for a loader of an IterableDataset
    without ``__len__``, which evaluate() takes in one process."""
    try:
        return len(loader)
    except TypeError:
        return None
