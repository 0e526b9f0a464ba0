"""The test toys that need no pytest: a tiny model, in-memory data, a recording callback, a toy
trainer, image folders on disk, the one weight comparison (:func:`weight_diff`) and a free port.

``tests/conftest.py`` re-exports every name here (tests import them from ``conftest``); the GPU
check kit (``tools/gpukit``) imports them from here, because the GPU machine has no pytest."""
import os
import signal
import socket
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn
from torch.utils.data import TensorDataset

from basetrainer.callbacks.callbacks import Callback
from basetrainer.engine import trainer as trainer_mod
from basetrainer.utils import setup_config


class TinyNet(nn.Module):
    """A 2-layer MLP on 16 features (no BatchNorm: exact DDP equivalence)."""

    def __init__(self, num_classes: int = 4, in_features: int = 16, hidden: int = 32, bn: bool = False) -> None:
        super().__init__()
        layers: List[nn.Module] = [nn.Linear(in_features, hidden)]
        if bn:
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.ReLU(), nn.Linear(hidden, num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def blobs(n: int = 128, num_classes: int = 4, dim: int = 16, seed: int = 0, noise: float = 0.5) -> TensorDataset:
    """Gaussian blobs around fixed class centres: linearly separable with a little noise."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(1234)) * 3
    y = torch.arange(n) % num_classes
    x = centres[y] + noise * torch.randn(n, dim, generator=g)
    return TensorDataset(x, y)


class Recorder(Callback):
    """Records every event (name and arguments that are numbers) and copies of ``logs``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: List[tuple] = []
        self.epoch_logs: List[dict] = []
        self.lrs: List[float] = []

    def _add(self, name: str, *args: Any) -> None:
        self.events.append((name,) + tuple(a for a in args if isinstance(a, int)))

    def on_train_begin(self, logs=None): self._add("on_train_begin")
    def on_train_end(self, logs=None): self._add("on_train_end")
    def on_epoch_begin(self, epoch, logs=None): self._add("on_epoch_begin", epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._add("on_epoch_end", epoch)
        self.epoch_logs.append(dict(logs))

    def on_batch_prepare(self, epoch, batch, logs=None): self._add("on_batch_prepare", epoch, batch)

    def on_batch_begin(self, batch, logs=None):
        self._add("on_batch_begin", batch)
        self.lrs.append(self.trainer.optimizer.param_groups[0]["lr"])

    def on_batch_end(self, batch, logs=None): self._add("on_batch_end", batch)
    def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None): self._add("on_train_summary", epoch, batch)
    def on_test_begin(self, logs=None): self._add("on_test_begin")
    def on_test_summary(self, inputs, outputs, losses, epoch, batch, logs=None): self._add("on_test_summary", epoch, batch)
    def on_test_end(self, logs=None): self._add("on_test_end")


class ToyTrainer(trainer_mod.EngineTrainer):
    """An EngineTrainer on blobs with TinyNet. ``cfg`` keys: n_train, n_test, num_classes,
    shuffle, bn, extra callbacks via ``callbacks`` argument."""

    def __init__(self, cfg: Any, callbacks: Optional[List[Any]] = None, model: Optional[nn.Module] = None) -> None:
        super().__init__(cfg)
        self._extra = callbacks or []
        self._model = model
        self.build(self.cfg)

    def build_train_loader(self, cfg, **kwargs):
        ds = blobs(cfg.get("n_train", 128), cfg.get("num_classes", 4), seed=0)
        return self.build_dataloader(ds, cfg.batch_size, cfg.num_workers, phase="train",
                                     shuffle=cfg.get("shuffle", True), drop_last=cfg.get("drop_last", False))

    def build_test_loader(self, cfg, **kwargs):
        n = cfg.get("n_test", 0)
        if not n:
            return None
        return self.build_dataloader(blobs(n, cfg.get("num_classes", 4), seed=1), cfg.batch_size, 0, phase="test",
                                     shuffle=False)

    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        model = self._model or TinyNet(cfg.get("num_classes", 4), bn=cfg.get("bn", False))
        return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)

    def build_criterion(self, cfg, **kwargs):
        return nn.CrossEntropyLoss()

    def build_optimizer(self, cfg, **kwargs):
        return torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.get("momentum", 0.0))

    def build_callbacks(self, cfg, **kwargs):
        return list(self._extra)


def toy_cfg(**overrides: Any) -> setup_config.Config:
    """A small config: CPU, no progress bars, 2 epochs, batch 16, lr 0.1, no data-wait advice (a
    toy's steps take microseconds, so its loader's share of an epoch can pass the 30 % of
    data_wait_warn on a loaded machine, and a line would be added to the logs tests read)."""
    cfg = setup_config.Config(gpu_id=[], progress=False, num_epochs=2, batch_size=16, lr=0.1, log_freq=2,
                              work_dir="", seed=0, data_wait_warn=0)
    cfg.update(overrides)
    return cfg


class StopAt(Callback):
    """Ends a run on purpose at one place, like a crash or a signal from outside: the one helper
    the tests stop runs with.

    Where, in epoch ``epoch``: after train step ``batch`` (0-based: after every ``on_batch_end``
    of it and the step's checkpoint, which the engine writes after them: at the next step's
    ``on_batch_prepare``, or ``on_test_begin`` after the epoch's last); with ``batch=None``, when the epoch begins; ``event`` picks another place:
    ``"batch_begin"`` (before step ``batch``), ``"test_begin"``, ``"test"`` (its first test batch)
    or ``"epoch_end"``. How: ``how`` is an exception class, raised with "stopped on purpose", or a
    signal number this process sends itself (``signal.SIGKILL``: a crash nothing catches;
    ``signal.SIGTERM``: a preemption). ``rank``: that rank only (None: every rank). Once."""

    def __init__(self, epoch: int, batch: Optional[int] = None, how: Any = RuntimeError,
                 event: Optional[str] = None, rank: Optional[int] = None) -> None:
        super().__init__()
        self.epoch, self.batch, self.how, self.rank = epoch, batch, how, rank
        self.event = event or ("batch_end" if batch is not None else "epoch_begin")
        self.done, self.after_step = False, False

    def _stop(self, event: str, epoch: int, batch: Optional[int] = None) -> None:
        if self.done or event != self.event or epoch != self.epoch:
            return
        if event in ("batch_begin", "batch_end") and batch != self.batch:
            return
        if self.rank is not None and self.trainer.rank != self.rank:
            return
        crash = not isinstance(self.how, int) or self.how == signal.SIGKILL   # SIGTERM only sets a flag: at once
        if event == "batch_end" and crash:   # once the step is over: its checkpoint is written after every on_batch_end
            self.after_step = True
            return
        self._fire()

    def _step_over(self) -> None:
        if self.after_step:
            self.after_step = False
            self._fire()

    def _fire(self) -> None:
        self.done = True
        if isinstance(self.how, int):
            os.kill(os.getpid(), self.how)
        else:
            raise self.how("stopped on purpose")

    def on_epoch_begin(self, epoch, logs=None):
        self._stop("epoch_begin", epoch)

    def on_batch_prepare(self, epoch, batch, logs=None):
        self._step_over()

    def on_batch_begin(self, batch, logs=None):
        self._stop("batch_begin", self.trainer.epoch, batch)

    def on_batch_end(self, batch, logs=None):
        self._stop("batch_end", self.trainer.epoch, batch)

    def on_test_begin(self, logs=None):
        self._step_over()
        self._stop("test_begin", self.trainer.epoch)

    def on_test_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self._stop("test", epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._stop("epoch_end", epoch)


def make_image_folder(root: str, classes: List[str], per_class: int = 4, size: int = 8) -> str:
    """Write ``per_class`` small PNGs per class under ``root/<class>/``."""
    from PIL import Image
    import numpy as np

    rng = np.random.default_rng(0)
    for ci, name in enumerate(classes):
        folder = os.path.join(root, name)
        os.makedirs(folder, exist_ok=True)
        for i in range(per_class):
            pixels = (rng.random((size, size)) * 60 + ci * 40).astype("uint8")
            Image.fromarray(pixels, mode="L").save(os.path.join(folder, f"{i}.png"))
    return root


Weights = Union[nn.Module, Dict[str, torch.Tensor]]


def weight_diff(a: Weights, b: Weights) -> float:
    """The largest absolute difference between two models' weights (modules or state dicts,
    compared in float64; NaN where either holds NaN, so ``weight_diff(...) <= tol`` fails then).

    Fails the test when the names or shapes differ. ``== 0.0`` is bitwise equality of values.
    """
    a = a.state_dict() if isinstance(a, nn.Module) else a
    b = b.state_dict() if isinstance(b, nn.Module) else b
    assert a.keys() == b.keys(), f"weights differ in names: only in a {sorted(a.keys() - b.keys())}, " \
                                 f"only in b {sorted(b.keys() - a.keys())}"
    worst = 0.0
    for k in a:
        x, y = torch.as_tensor(a[k]).detach().cpu(), torch.as_tensor(b[k]).detach().cpu()
        assert x.shape == y.shape, f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if x.numel():
            d = float((x.double() - y.double()).abs().max())
            if d != d:
                return d
            worst = max(worst, d)
    return worst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

