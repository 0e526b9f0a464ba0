"""The kit's image toys (tests/toys.py has the feature-vector ones): a small CNN with BatchNorm
on synthetic 3x16x16 images whose class is a fixed linear function of the pixels, and a trainer
of it (synthetic classes that a CNN learns in a few dozen steps). Conv layers are what channels_last, compile, cudnn and AMP change; the toy is small so
that every check that uses it takes seconds."""
import math
from typing import Any, List

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from basetrainer.callbacks.callbacks import Callback
from toys import ToyTrainer


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(4))
        self.head = nn.Linear(2 * width * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def images(n: int = 256, num_classes: int = 10, size: int = 16, seed: int = 0) -> TensorDataset:
    """``n`` 3 x size x size images: a fixed random pattern per class plus as much noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_classes, 3, size, size, generator=torch.Generator().manual_seed(1234))
    y = torch.arange(n) % num_classes
    return TensorDataset(patterns[y] + torch.randn(n, 3, size, size, generator=g), y)


class ImageTrainer(ToyTrainer):
    """ToyTrainer on :func:`images` with :class:`SmallCNN` (cfg: n_train, n_test, shuffle)."""

    def build_train_loader(self, cfg: Any, **kwargs: Any) -> DataLoader:
        return self.build_dataloader(images(cfg.get("n_train", 256)), cfg.batch_size, cfg.num_workers,
                                     phase="train", shuffle=cfg.get("shuffle", True))

    def build_test_loader(self, cfg: Any, **kwargs: Any) -> Any:
        n = cfg.get("n_test", 0)
        return self.build_dataloader(images(n, seed=1), cfg.batch_size, 0, phase="test", shuffle=False) if n else None

    def build_model(self, cfg: Any, **kwargs: Any) -> nn.Module:
        torch.manual_seed(cfg.seed)
        return self.build_model_parallel(SmallCNN(), cfg.gpu_id, distributed=cfg.distributed)


class StepLosses(Callback):
    """Keeps every train step's loss (on the device; read once at the end: no per-step sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: List[torch.Tensor] = []

    def on_train_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int, logs: Any = None) -> None:
        self.losses.append(losses.detach().float().reshape(()))

    def values(self) -> List[float]:
        return torch.stack(self.losses).cpu().tolist() if self.losses else []


def finite(values: List[float]) -> bool:
    return all(math.isfinite(v) for v in values)


class no_tf32:
    """TF32 off for cuBLAS and cuDNN inside (the comparisons below are of float32 arithmetic)."""

    def __enter__(self) -> "no_tf32":
        self.saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved
