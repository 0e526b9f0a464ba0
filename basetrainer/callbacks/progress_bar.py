"""tqdm progress bars for the train and test phases (main process only)."""
from typing import Any, Optional

from basetrainer.callbacks.callbacks import Callback


class ProgressBar(Callback):
    """One bar per phase. The engine adds it when ``progress`` is on, in the main process.

    The bar shows the figures the recorders publish every ``log_freq`` steps; it reads no tensor.
    """

    def __init__(self) -> None:
        super().__init__()
        self._bar: Any = None

    def _open(self, total: int, desc: str) -> None:
        from tqdm import tqdm

        self._close()
        self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False)

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
            self._open(len(loader), f"Test  epoch {self.trainer.epoch}")

    def on_test_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                        logs: Optional[dict] = None) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def on_test_end(self, logs: Optional[dict] = None) -> None:
        self._close()

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        self._close()
