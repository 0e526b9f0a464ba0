"""Stop training when a figure stops improving."""
import logging
from typing import Any, Dict, Optional

from basetrainer.callbacks.callbacks import Callback, infer_mode, mode_of_indicator, resolve_indicator

_logger = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Sets ``trainer.stop_training`` after ``patience`` epochs without improvement.

    The figure is read from ``logs`` at each epoch end, where it is already reduced over every
    process, so all ranks take the same decision; the engine also agrees on the flag across
    ranks before it stops.

    Args:
        indicator: the figure (``"loss"`` = ``test/loss`` when there is a test loader).
        patience: epochs without improvement before stopping.
        min_delta: an improvement must exceed this.
        mode: ``"max"`` or ``"min"``; when omitted the recorder that writes the indicator
            decides at ``on_train_begin`` (a MetricRecorder's ``higher_is_better``), else the
            name (losses are min).
        logger: where the decision is logged.
    """

    def __init__(self, indicator: str = "loss", patience: int = 5, min_delta: float = 0.0,
                 mode: Optional[str] = None, logger: Optional[logging.Logger] = None) -> None:
        super().__init__()
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience={patience!r} must be a positive integer number of epochs")
        if min_delta < 0:
            raise ValueError(f"min_delta={min_delta!r} must be >= 0")
        self._mode_given = mode is not None
        mode = mode or infer_mode(indicator)
        if mode not in ("max", "min"):
            raise ValueError(f"mode={mode!r} must be 'max' or 'min'")
        self.indicator, self.patience, self.min_delta, self.mode = indicator, patience, min_delta, mode
        self.logger = logger or _logger
        self.best: Optional[float] = None
        self.wait = 0
        self.stopped_epoch: Optional[int] = None

    @property
    def state_key(self) -> str:
        return f"EarlyStopping:{self.indicator}"

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if not self._mode_given:   # the recorder of the figure knows better than its name
            self.mode = mode_of_indicator(self.indicator, self.trainer) or infer_mode(self.indicator)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        key = resolve_indicator(self.indicator, self.trainer)
        if not logs or key not in logs:
            raise KeyError(f"EarlyStopping indicator {self.indicator!r} -> logs[{key!r}] is missing; add the "
                           f"recorder that writes it, or change indicator")
        value = float(logs[key])
        better = (self.best is None or
                  (value > self.best + self.min_delta if self.mode == "max" else value < self.best - self.min_delta))
        if better:
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            self.trainer.stop_training = True
            if self.is_main_process:
                self.logger.info("early stop at epoch %d: %s has not improved on %.6g for %d epochs",
                                 epoch, key, self.best, self.patience)

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best, self.wait = state.get("best"), int(state.get("wait", 0))
