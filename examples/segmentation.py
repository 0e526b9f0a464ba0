"""Semantic segmentation with basetrainer, on shapes drawn on the fly (no download).

Each image holds one to three shapes (circle, square, triangle; random size, rotation, colour,
possibly overlapping) on a noisy background; its mask labels every pixel 0 (background) or the
shape's class. Sample ``i`` is drawn from a generator seeded by (seed, split, i), so every
rank, worker and resumed run sees the same sample. The model is a small U-Net written here
(no downloaded weights) with an auxiliary head on its bottleneck, as torchvision's segmentation
models have one; ``--net_type deeplabv3_mobilenet_v3_large`` trains torchvision's (weights=None)
instead.

What it shows: dict batches (``{"image", "mask"}``), a ``run_step`` override returning a dict of
losses (main + auxiliary, each recorded by MultiLossesRecorder), per-class and mean IoU through
MetricRecorder (torchmetrics JaccardIndex, exact over DDP ranks) and ModelCheckpoint by mean IoU.

    python examples/segmentation.py                      # one process
    python examples/segmentation.py --distributed        # DDP, 2 processes (gloo on the CPU)
    python examples/segmentation.py --num_train 1024 --num_epochs 2 --work_dir work_space/shapes_small
"""
import argparse
import math
import os
import time
from typing import Any, Dict, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import basetrainer
from basetrainer.callbacks import log_history, model_checkpoint, multi_losses_recorder
from basetrainer.engine import trainer
from basetrainer.engine.launch import launch
from basetrainer.optimizer.build_optimizer import get_optimizer
from basetrainer.runtime import errors
from basetrainer.scheduler import build_scheduler
from basetrainer.utils import file_utils, log, setup_config

CLASSES = ["background", "circle", "square", "triangle"]
_SPLITS = {"train": 0, "test": 1}


class SyntheticShapes(Dataset):
    """``num_samples`` images of random shapes with their per-pixel class masks.

    Args:
        num_samples: the data set's length.
        size: images are ``size x size`` pixels.
        seed: with ``split`` and the index, seeds each sample's generator.
        split: ``"train"`` or ``"test"`` (disjoint sample streams).

    Returns (per item): ``{"image": float [3, size, size] in [-1, 1], "mask": long [size, size]}``.
    """

    def __init__(self, num_samples: int, size: int, seed: int, split: str = "train") -> None:
        if split not in _SPLITS:
            raise ValueError(f"split={split!r} must be one of {sorted(_SPLITS)}")
        self.num_samples, self.size, self.seed, self.split = int(num_samples), int(size), int(seed), split
        grid = torch.arange(self.size, dtype=torch.float32) + 0.5
        self._ys, self._xs = torch.meshgrid(grid, grid, indexing="ij")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        state = np.random.SeedSequence([self.seed, _SPLITS[self.split], int(index)]).generate_state(2)
        g = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        size, xs, ys = self.size, self._xs, self._ys
        image = torch.rand(3, 1, 1, generator=g) + (torch.rand(3, 1, 1, generator=g) - 0.5) * 0.6 * (xs / size - 0.5)
        mask = torch.zeros(size, size, dtype=torch.long)
        for _ in range(1 + int(torch.randint(3, (1,), generator=g))):
            cls = 1 + int(torch.randint(3, (1,), generator=g))
            cx, cy = ((0.15 + 0.7 * torch.rand(2, generator=g)) * size).tolist()
            radius = float((0.14 + 0.12 * torch.rand(1, generator=g)) * size)
            angle = float(torch.rand(1, generator=g)) * 2 * math.pi
            inside = self._shape(cls, xs - cx, ys - cy, radius, angle)
            image = torch.where(inside, torch.rand(3, 1, 1, generator=g), image)
            mask[inside] = cls
        image = image + 0.12 * torch.randn(3, size, size, generator=g)
        return {"image": image.clamp(0, 1) * 2 - 1, "mask": mask}

    @staticmethod
    def _shape(cls: int, dx: torch.Tensor, dy: torch.Tensor, radius: float, angle: float) -> torch.Tensor:
        if cls == 1:    # circle
            return dx * dx + dy * dy <= radius * radius
        if cls == 2:    # square, rotated
            c, s = math.cos(angle), math.sin(angle)
            half = 0.85 * radius
            return ((c * dx + s * dy).abs() <= half) & ((c * dy - s * dx).abs() <= half)
        inside = torch.ones_like(dx, dtype=torch.bool)    # triangle: three half-planes
        for k in range(3):
            a = angle + k * 2 * math.pi / 3
            inside &= math.cos(a) * dx + math.sin(a) * dy <= 0.62 * radius
        return inside


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                         nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """A four-level U-Net; returns ``{"out": logits, "aux": logits}`` like torchvision's
    segmentation models (the auxiliary head reads the bottleneck, upsampled to the input)."""

    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        w = width
        self.enc = nn.ModuleList([_double_conv(3, w), _double_conv(w, 2 * w), _double_conv(2 * w, 4 * w),
                                  _double_conv(4 * w, 8 * w)])
        self.up = nn.ModuleList([nn.ConvTranspose2d(8 * w, 4 * w, 2, 2), nn.ConvTranspose2d(4 * w, 2 * w, 2, 2),
                                 nn.ConvTranspose2d(2 * w, w, 2, 2)])
        self.dec = nn.ModuleList([_double_conv(8 * w, 4 * w), _double_conv(4 * w, 2 * w), _double_conv(2 * w, w)])
        self.head = nn.Conv2d(w, num_classes, 1)
        self.aux = nn.Conv2d(8 * w, num_classes, 1)

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        skips = []
        h = x
        for i, block in enumerate(self.enc):
            h = block(h if i == 0 else F.max_pool2d(h, 2))
            skips.append(h)
        bottom = h
        for up, block, skip in zip(self.up, self.dec, reversed(skips[:-1])):
            h = block(torch.cat([up(h), skip], dim=1))
        aux = F.interpolate(self.aux(bottom), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return {"out": self.head(h), "aux": aux}


def _deeplabv3(num_classes: int, width: int) -> nn.Module:
    from torchvision.models import segmentation

    return segmentation.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=num_classes,
                                                     aux_loss=True)


_MODELS = {"unet": UNet, "deeplabv3_mobilenet_v3_large": _deeplabv3}


class SegmentationTrainer(trainer.EngineTrainer):
    """Semantic segmentation: dict batches, main + auxiliary loss, IoU by MetricRecorder."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        cfg.model_root = os.path.join(cfg.work_dir, "model")
        cfg.log_root = os.path.join(cfg.work_dir, "log")
        if self.is_main_process:
            file_utils.create_dir(cfg.model_root)
            file_utils.create_dir(cfg.log_root)
            setup_config.save_config(cfg, os.path.join(cfg.work_dir, "setup_config.yaml"))
        self.logger = log.set_logger(level="info", logfile=os.path.join(cfg.log_root, "train.log"),
                                     is_main_process=self.is_main_process)
        self.aux_weight = float(cfg.aux_weight)
        self.build(cfg)
        self.logger.info("work_dir: %s | device: %s | processes: %d | train samples: %d | %dx%d | classes: %s",
                         cfg.work_dir, self.device, self.world_size, self.num_samples, cfg.image_size,
                         cfg.image_size, CLASSES)

    def build_train_loader(self, cfg: Any, **kwargs: Any) -> Any:
        cfg.num_classes, cfg.classes = len(CLASSES), CLASSES
        dataset = SyntheticShapes(cfg.num_train, cfg.image_size, cfg.seed, "train")
        return self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="train", shuffle=True,
                                     drop_last=False, distributed=cfg.distributed)

    def build_test_loader(self, cfg: Any, **kwargs: Any) -> Any:
        if not cfg.num_test:
            return None
        dataset = SyntheticShapes(cfg.num_test, cfg.image_size, cfg.seed, "test")
        return self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="test", shuffle=False,
                                     distributed=cfg.distributed)

    def build_model(self, cfg: Any, **kwargs: Any) -> nn.Module:
        model = _MODELS[cfg.net_type](cfg.num_classes, cfg.width)
        return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)

    def build_criterion(self, cfg: Any, **kwargs: Any) -> nn.Module:
        return nn.CrossEntropyLoss()

    def build_optimizer(self, cfg: Any, **kwargs: Any) -> torch.optim.Optimizer:
        return get_optimizer(self.model, optim_type=cfg.optim_type, lr=cfg.lr, momentum=cfg.momentum,
                             weight_decay=cfg.weight_decay)

    def run_step(self, batch: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """Forward a ``{"image", "mask"}`` batch: outputs ``{"out", "aux"}``, losses of each head."""
        outputs = self.model(batch["image"])
        losses = {"main": self.criterion(outputs["out"], batch["mask"])}
        if "aux" in outputs and self.aux_weight:
            losses["aux"] = self.aux_weight * self.criterion(outputs["aux"], batch["mask"])
        return outputs, losses

    def build_callbacks(self, cfg: Any, **kwargs: Any) -> list:
        from torchmetrics.classification import MulticlassJaccardIndex

        from basetrainer.metric.metric_recorder import MetricRecorder

        k = cfg.num_classes
        return [
            multi_losses_recorder.MultiLossesRecorder(indicator="loss"),     # train/main, train/aux, train/loss
            # IoU of each class as test/IoU_<i> (per_class) and their mean, the mean IoU, as test/IoU
            MetricRecorder(MulticlassJaccardIndex(num_classes=k, average=None, validate_args=False), indicator="IoU",
                           target_key="mask", per_class=True),
            build_scheduler.get_scheduler(cfg.scheduler, optimizer=self.optimizer, lr_init=cfg.lr,
                                          num_epochs=cfg.num_epochs, num_steps=self.num_steps,
                                          milestones=cfg.milestones, num_warn_up=cfg.num_warn_up),
            log_history.LogHistory(log_dir=cfg.log_root, log_freq=cfg.log_freq, logger=self.logger,
                                   indicators=["loss", "aux", "IoU"], is_main_process=self.is_main_process),
            model_checkpoint.ModelCheckpoint(model=self.model, optimizer=self.optimizer, model_dir=cfg.model_root,
                                             epochs=cfg.num_epochs, indicator="IoU", logger=self.logger),
        ]


def per_class_iou(row: Dict[str, Any], phase: str = "test") -> Dict[str, float]:
    """``{class name: IoU}`` from one epoch's figures (``<phase>/IoU_<i>``)."""
    return {name: row[f"{phase}/IoU_{i}"] for i, name in enumerate(CLASSES) if f"{phase}/IoU_{i}" in row}


def main(cfg: Any) -> Any:
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    start = time.perf_counter()
    t = SegmentationTrainer(cfg)
    history = t.run()
    if t.is_main_process and history.last is not None:
        phase = "test" if "test/IoU" in history.last else "train"
        ious = per_class_iou(history.last, phase)
        # the whole run's, a resumed one included (history holds only the epochs of this call)
        ckpt = next(c for c in t.callbacks if isinstance(c, model_checkpoint.ModelCheckpoint))
        best = ckpt.best if ckpt.best is not None else max(v for v in history[f"{phase}/IoU"] if v is not None)
        shapes = [ious[c] for c in CLASSES[1:]]
        print(f"final {phase}/IoU: " + ", ".join(f"{c} {v:.4f}" for c, v in ious.items())
              + f"; min over shapes {min(shapes):.4f}; mean IoU {history.last[f'{phase}/IoU']:.4f} (best {best:.4f}) "
              f"after {history.last['epoch'] + 1} epochs in {time.perf_counter() - start:.1f} s; work_dir: {cfg.work_dir}",
              flush=True)
    return history


def _positive(kind: type, name: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name} must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"--{name} must be > 0, got {text!r}")
        return value
    return parse


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="basetrainer semantic segmentation example (synthetic shapes)")
    parser.add_argument("-c", "--config_file", default=None, help="optional YAML config (typed flags override it)")
    parser.add_argument("--work_dir", default="work_space/shapes", help="output folder")
    parser.add_argument("--net_type", default="unet", choices=sorted(_MODELS))
    parser.add_argument("--width", type=_positive(int, "width"), default=16, help="U-Net channels of the first level")
    parser.add_argument("--image_size", type=_positive(int, "image_size"), default=32,
                        help="image side in pixels (a multiple of 8 for the U-Net)")
    parser.add_argument("--num_train", type=_positive(int, "num_train"), default=3072, help="train images per epoch")
    parser.add_argument("--num_test", type=int, default=512, help="test images (0: no test phase)")
    parser.add_argument("--batch_size", type=_positive(int, "batch_size"), default=32, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--optim_type", default="AdamW")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight_decay", type=float, default=1e-4)
    parser.add_argument("--scheduler", default="cosine")
    parser.add_argument("--milestones", nargs="+", type=int, default=[4, 5])
    parser.add_argument("--num_epochs", type=_positive(int, "num_epochs"), default=6)
    parser.add_argument("--num_warn_up", type=float, default=1, help="epochs of LR warm-up (a fraction too)")
    parser.add_argument("--aux_weight", type=float, default=0.4, help="weight of the auxiliary head's loss (0: none)")
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--num_threads", type=int, default=1,
                        help="torch threads per process (0: torch's choice). 1 by default: on a CPU shared with "
                             "other jobs, two threads per process spin against each other (measured: 6 vs 250 "
                             "images/s); DDP on the CPU gives each process its share of the cores anyway")
    parser.add_argument("--gpu_id", nargs="*", type=int, default=[0], help="GPU ids ([] = CPU)")
    parser.add_argument("--seed", type=int, default=2020)
    parser.add_argument("--log_freq", type=int, default=20)
    parser.add_argument("--resume", default="", help="'auto' (continue the run in work_dir) or a checkpoint path")
    parser.add_argument("--overwrite", action="store_true", help="move an earlier run in work_dir aside")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--distributed", action="store_true", help="one process per gpu_id entry (DDP)")
    return setup_config.add_engine_flags(parser)   # every other key of the config table: --sync_bn, --ema, ...


def parse_config(argv: Any = None) -> Any:
    parser = get_parser()
    args = parser.parse_args(argv)
    cfg = setup_config.parser_config(args, cfg_updata=True, parser=parser, argv=argv)
    if cfg.net_type == "unet" and cfg.image_size % 8:
        parser.error(f"--image_size {cfg.image_size}: the U-Net halves the image three times; use a multiple of 8")
    if cfg.num_test < 0:
        parser.error(f"--num_test must be >= 0, got {cfg.num_test}")
    if cfg.distributed and len(cfg.gpu_id) < 2 and not torch.cuda.is_available():
        cfg.gpu_id = [0, 1]     # two CPU processes, as `--distributed --gpu_id 0 1` would start
    return cfg


if __name__ == "__main__":
    with errors.exit_on_usage_error():   # a user error: "error: <message>", exit status 2, no traceback
        cfg = parse_config()
        print(f"basetrainer {basetrainer.__version__}", flush=True)
        launch(main, num_gpus_per_machine=max(1, len(cfg.gpu_id)), dist_url="auto", num_machines=1, machine_rank=0,
               distributed=cfg.distributed, args=(cfg,))
