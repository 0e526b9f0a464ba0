"""The loops ``bench_gpu.py`` times, each training the same model on the same batches (already on
the device): a hand-written PyTorch loop, basetrainer, Lightning and Accelerate (the last two
when importable; on the GPU machine they are). Each ``epoch()`` trains one pass over the batches
and returns its seconds (the device synchronised at both ends) and its first ``HEAD`` step
losses, read after the clock stopped.

Settings: SGD (lr 0.01, momentum 0.9), cross-entropy, AMP bf16, channels_last, cudnn.benchmark
(set once for all). basetrainer: an ``EngineTrainer`` with no callbacks but the clock (progress
off), one more epoch per ``run()`` call, timed from ``on_epoch_begin`` to the end of its train
phase (a run's own start and end, paid once per run, are left out); Lightning: ``L.Trainer`` with the progress bar, logger, checkpointing and model summary
off (a new Trainer per epoch, untimed setup); Accelerate: ``Accelerator(mixed_precision="bf16")``,
``prepare`` on model and optimizer, ``accelerator.backward``.
"""
import time
from typing import Any, Callable, List, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from basetrainer.callbacks.callbacks import Callback
from basetrainer.engine.trainer import EngineTrainer
from basetrainer.utils import setup_config

LR, MOMENTUM = 0.01, 0.9
# The step losses that show two loops doing the same work: from the same weights on the same
# batches they agree to rounding. Later steps do not show it: this training is unstable (on the
# H200, 2026-11-28, ResNet-9's loss went 5.6, 6.9, 15, 21, 31, 23 in the first six steps), so
# rounding differences grow by about 3x a step; a loss computed outside autocast on float32
# outputs (Accelerate's way) moved the warm-up epoch's mean loss by 0.8 % in one process and
# 5.1 % in another, with the first three losses within 2e-4.
HEAD = 3


class DeviceBatches(Dataset):
    """``steps`` batches cycling over ``distinct`` synthetic batches made on the device."""

    def __init__(self, steps: int, batch: int, size: int, classes: int, device: torch.device, distinct: int = 4) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.steps = steps
        self.data = [(torch.randn(batch, 3, size, size, device=device, generator=g).contiguous(memory_format=torch.channels_last),
                      torch.randint(0, classes, (batch,), device=device, generator=g)) for _ in range(distinct)]

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.data[i % len(self.data)]


def loader(batches: DeviceBatches) -> DataLoader:
    return DataLoader(batches, batch_size=None, shuffle=False)   # yields the batches as they are


def sync(device: torch.device) -> float:
    """``time.perf_counter()`` after the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _head(losses: List[torch.Tensor]) -> List[float]:
    """The first ``HEAD`` step losses, as floats (one host sync, after the clock stopped)."""
    return torch.stack(losses[:HEAD]).float().tolist()


class Hand:
    name = "hand"

    def __init__(self, model: nn.Module, data: DataLoader, device: torch.device) -> None:
        self.model, self.data, self.device = model.to(device, memory_format=torch.channels_last), data, device
        self.opt = _optimizer(self.model)

    def epoch(self) -> Tuple[float, List[float]]:
        losses = []
        t0 = sync(self.device)
        for x, y in self.data:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return sync(self.device) - t0, _head(losses)


class _Clock(Callback):
    """Seconds of the train phase (synchronised) and the mean step loss, for basetrainer."""

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.losses: List[torch.Tensor] = []
        self.t0 = sync(self.trainer.device)

    def on_train_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int, logs: Any = None) -> None:
        self.losses.append(losses.detach())

    def on_test_begin(self, logs: Any = None) -> None:
        self.seconds = sync(self.trainer.device) - self.t0


class _OursTrainer(EngineTrainer):
    def __init__(self, cfg: Any, model: nn.Module, data: DataLoader) -> None:
        self._model, self._data, self.clock = model, data, _Clock()
        super().__init__(cfg)
        self.build(self.cfg)

    def build_train_loader(self, cfg, **kwargs): return self._data
    def build_test_loader(self, cfg, **kwargs): return None
    def build_model(self, cfg, **kwargs): return self.build_model_parallel(self._model, cfg.gpu_id)
    def build_criterion(self, cfg, **kwargs): return nn.CrossEntropyLoss()
    def build_optimizer(self, cfg, **kwargs): return _optimizer(self.model)
    def build_callbacks(self, cfg, **kwargs): return [self.clock]


class Ours:
    name = "basetrainer"

    def __init__(self, model: nn.Module, data: DataLoader, device: torch.device) -> None:
        cfg = setup_config.Config(gpu_id=[device.index or 0] if device.type == "cuda" else [], amp="bf16",
                                  channels_last=True, progress=False, num_epochs=1, batch_size=1, seed=0,
                                  work_dir="", log_freq=50)
        self.trainer, self.done = _OursTrainer(cfg, model, data), 0

    def epoch(self) -> Tuple[float, List[float]]:
        """One more epoch: ``run()`` goes on from the epochs the earlier calls trained."""
        t = self.trainer
        t.num_epochs, t.clock.seconds = self.done + 1, None
        t.run()
        self.done += 1
        assert t.clock.seconds is not None, f"run() trained no epoch (start {t.start_epoch}, num_epochs {t.num_epochs})"
        return t.clock.seconds, _head(t.clock.losses)


class LightningLoop:
    name = "lightning"

    def __init__(self, model: nn.Module, data: DataLoader, device: torch.device) -> None:
        import lightning as L

        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model, self.losses = model.to(memory_format=torch.channels_last), []

            def training_step(self, batch: Any, i: int) -> torch.Tensor:
                loss = nn.functional.cross_entropy(self.model(batch[0]), batch[1])
                self.losses.append(loss.detach())
                return loss

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return _optimizer(self.model)

        class Clock(L.Callback):
            def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
                module.losses, self.t0 = [], sync(device)

            def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
                self.seconds = sync(device) - self.t0

        self.L, self.module, self.clock, self.data, self.device = L, Module(), Clock(), data, device

    def epoch(self) -> Tuple[float, List[float]]:
        trainer = self.L.Trainer(accelerator="gpu" if self.device.type == "cuda" else "cpu", devices=1,
                                 precision="bf16-mixed", max_epochs=1, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=[self.clock],
                                 num_sanity_val_steps=0)
        trainer.fit(self.module, self.data)
        return self.clock.seconds, _head(self.module.losses)


_ACCELERATOR: List[Any] = []   # Accelerate's state is one per process


class AccelerateLoop:
    name = "accelerate"

    def __init__(self, model: nn.Module, data: DataLoader, device: torch.device) -> None:
        from accelerate import Accelerator

        if not _ACCELERATOR:
            _ACCELERATOR.append(Accelerator(mixed_precision="bf16", cpu=device.type != "cuda"))
        self.acc = _ACCELERATOR[0]
        model = model.to(memory_format=torch.channels_last)
        self.model, self.opt = self.acc.prepare(model, _optimizer(model))
        self.data, self.device = data, device

    def epoch(self) -> Tuple[float, List[float]]:
        losses = []
        t0 = sync(self.device)
        for x, y in self.data:
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.acc.backward(loss)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return sync(self.device) - t0, _head(losses)


PEERS: List[Tuple[str, Callable]] = [("lightning", LightningLoop), ("accelerate", AccelerateLoop)]
