"""GPU speed: basetrainer against a hand-written loop doing the same work on the same GPU, in the
same process, interleaved (the order turning each round), the ratio of seconds per epoch as a
median with its bootstrap 95% interval (bench/loop_stats.py's ``paired``).

    python3 bench/bench_gpu.py                 # every case on cuda:0 (part of tools/gpu_check.sh)
    python3 bench/bench_gpu.py --cpu           # tiny sizes on the CPU: the code paths only
    python3 bench/bench_gpu.py --cases resnet50_bf16

Cases (each a check of the GPU kit, tools/gpukit/checks_speed.py):

- ``resnet50_bf16``: torchvision resnet50, AMP bf16, batch 128 at 224x224, channels_last,
  synthetic data on the GPU. Budget: basetrainer <= 1.02x the hand loop (median ratio).
- ``small_resnet_b512``: a CIFAR-sized ResNet-9 (the DAWNBench CIFAR-10 records' net), batch
  512 at 32x32, AMP bf16, channels_last, data on the GPU: a step takes milliseconds, so the
  loop's own cost shows. Budget: <= 1.05x.
- ``peers``: Lightning and Accelerate on the same two models, each against the hand loop.
- ``loader_digits``: images/s of the default loader (``build_dataloader(..., phase="train")``,
  ``pin_memory`` on CUDA) on the digits ImageFolder through examples/example.py's training
  transforms, with 0 and 4 workers, each batch copied to the device ``non_blocking``; against
  a plain ``DataLoader(shuffle=True, pin_memory=True, persistent_workers=True)``.

The first epoch of every contender is a warm-up (cudnn's autotuning, workers starting), untimed,
and from the same initial weights: its first three step losses must agree with the hand loop's
within 1 % (the same work; see ``gpu_contenders.HEAD`` for why not the epoch's mean). Dry run (``--cpu``): 2 steps of batch 2-4 at 8x8, a ResNet-9 of width 8
standing in for both models, 2 rounds; no budget applies.
"""
import argparse
import copy
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT, os.path.join(ROOT, "tools"), os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.append(path)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gpu_contenders as contenders_mod  # noqa: E402
import loop_stats  # noqa: E402

BUDGET = {"resnet50_bf16": 1.02, "small_resnet_b512": 1.05}
# (batch, size, classes, steps per timed epoch, rounds) on the GPU / in the dry run
SIZES = {"resnet50_bf16": ((128, 224, 1000, 16, 7), (2, 8, 10, 2, 2)),
         "small_resnet_b512": ((512, 32, 10, 40, 12), (4, 8, 10, 2, 2))}
SAME_WORK = 0.01   # the warm-up epoch's first step losses, relative to the hand loop's (the largest)


def _conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class _Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv_bn(c, c), _conv_bn(c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def resnet9(num_classes: int = 10, width: int = 64) -> nn.Module:
    """ResNet-9 for 32x32 inputs: prep 64, layers of 128 (+residual), 256, 512 (+residual)
    (``width`` 64; the dry run's stand-in has 8)."""
    w = width
    return nn.Sequential(_conv_bn(3, w), _conv_bn(w, 2 * w), nn.MaxPool2d(2), _Residual(2 * w),
                         _conv_bn(2 * w, 4 * w), nn.MaxPool2d(2), _conv_bn(4 * w, 8 * w), nn.MaxPool2d(2),
                         _Residual(8 * w), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(8 * w, num_classes))


def _model(case: str, classes: int, dry: bool) -> nn.Module:
    torch.manual_seed(0)
    if dry:   # the 2-core CPU takes seconds per step of resnet50, even at 8x8: a stand-in
        return resnet9(classes, width=8)
    if case == "resnet50_bf16":
        import torchvision

        return torchvision.models.resnet50(num_classes=classes)
    return resnet9(classes)


def interleave(contenders: Dict[str, Any], rounds: int) -> Dict[str, Any]:
    """A warm-up epoch each, then ``rounds`` rounds of one epoch each, the order turning."""
    names = list(contenders)
    warm = {n: contenders[n].epoch()[1] for n in names}   # a model loop's first losses; a loader's images
    seconds: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            seconds[n].append(contenders[n].epoch()[0])
    return {"warm": warm, "seconds": seconds}


def model_case(case: str, device: torch.device, dry: bool, peers: bool = False) -> Dict[str, Any]:
    """basetrainer (or, with ``peers``, Lightning and Accelerate) against the hand loop on ``case``."""
    batch, size, classes, steps, rounds = SIZES[case][1 if dry else 0]
    data = contenders_mod.loader(contenders_mod.DeviceBatches(steps, batch, size, classes, device))
    base = _model(case, classes, dry)
    kinds: List[Tuple[str, Callable]] = list(contenders_mod.PEERS) if peers else [("basetrainer", contenders_mod.Ours)]
    contenders, missing = {"hand": contenders_mod.Hand(copy.deepcopy(base), data, device)}, {}
    for name, kind in kinds:
        try:
            contenders[name] = kind(copy.deepcopy(base), data, device)
        except ImportError as e:
            missing[name] = f"{type(e).__name__}: {e}"
    if len(contenders) == 1:
        return {"missing": missing}
    benchmark, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, True
    try:
        runs = interleave(contenders, rounds)
    finally:
        torch.backends.cudnn.benchmark = benchmark
    figure: Dict[str, Any] = {"steps": steps, "rounds": rounds, "batch": batch,
                              "hand_ms_per_step": 1e3 * min(runs["seconds"]["hand"]) / steps}
    for name in contenders:
        if name == "hand":
            continue
        stats = loop_stats.paired(runs["seconds"][name], runs["seconds"]["hand"], steps)
        same = max(abs(a - b) / abs(b) for a, b in zip(runs["warm"][name], runs["warm"]["hand"], strict=True))
        figure[name] = {"ratio": stats["ratio"], "interval": [stats["ratio_lo"], stats["ratio_hi"]],
                        "overhead_us_per_step": stats["overhead_us"], "first_losses_rel": same}
    figure["missing"] = missing
    return figure


class _Pass:
    """One epoch through a loader (its sampler told the epoch), each batch copied to the device;
    ``epoch()`` returns the seconds and the number of images."""

    def __init__(self, data: Any, device: torch.device) -> None:
        self.data, self.device, self.epoch_no = data, device, 0

    def epoch(self) -> Tuple[float, float]:
        from basetrainer.dataloader import loader as loaders_mod

        loaders_mod.set_epoch(self.data, self.epoch_no, 0, 0)
        self.epoch_no += 1
        pin = self.device.type == "cuda"
        n, t0 = 0, contenders_mod.sync(self.device)
        for x, y in self.data:
            x, y = x.to(self.device, non_blocking=pin), y.to(self.device, non_blocking=pin)
            n += len(y)
        return contenders_mod.sync(self.device) - t0, float(n)


def loader_case(root: str, device: torch.device, dry: bool) -> Dict[str, Any]:
    """Images/s of the default loader and of a plain DataLoader on the digits, 0 and 4 workers."""
    from torch.utils.data import DataLoader

    from basetrainer.dataloader.image_folder import image_folder
    from basetrainer.engine.trainer import EngineTrainer
    from basetrainer.utils import setup_config

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import example

    cfg = setup_config.Config(gpu_id=[0] if device.type == "cuda" else [], progress=False, seed=0, work_dir="",
                              input_size=[32, 32])
    trainer = EngineTrainer(cfg)
    dataset = image_folder(root, transform=example.ClassificationTrainer.transforms(None, cfg, train=True))
    pin = device.type == "cuda"
    figure: Dict[str, Any] = {"images": len(dataset), "pin_memory": pin}
    for workers in ((0, 2) if dry else (0, 4)):
        loaders = {"basetrainer": trainer.build_dataloader(dataset, 32, workers, phase="train"),
                   "hand": DataLoader(dataset, 32, shuffle=True, num_workers=workers, pin_memory=pin,
                                      persistent_workers=workers > 0)}
        assert trainer.build_dataloader(dataset, 32, workers, phase="train").pin_memory == pin, "pin_memory default"

        runs = interleave({k: _Pass(v, device) for k, v in loaders.items()}, 1 if dry else 4)
        steps = len(loaders["hand"])
        stats = loop_stats.paired(runs["seconds"]["basetrainer"], runs["seconds"]["hand"], steps)
        images = runs["warm"]   # the warm-up pass returns the images it saw
        assert images["basetrainer"] == images["hand"] == len(dataset), f"images per epoch {images}"
        best = {k: len(dataset) / min(v) for k, v in runs["seconds"].items()}
        figure[f"w{workers}"] = {"images_per_s": best["basetrainer"], "hand_images_per_s": best["hand"],
                                 "ratio": stats["ratio"], "interval": [stats["ratio_lo"], stats["ratio_hi"]]}
    return figure


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (the code paths only)")
    parser.add_argument("--cases", nargs="+", default=["resnet50_bf16", "small_resnet_b512", "peers", "loader_digits"])
    parser.add_argument("--digits", default=None, help="the digits ImageFolder (default: made in a temporary folder)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    for case in args.cases:
        start = time.perf_counter()
        if case == "loader_digits":
            sys.path.insert(0, os.path.join(ROOT, "examples"))
            from prepare_data import prepare_digits

            root = args.digits or prepare_digits(os.path.join(tempfile.mkdtemp(prefix="digits-"), "digits"))
            figure = loader_case(os.path.join(root, "train"), device, args.cpu)
        elif case == "peers":
            figure = {m: model_case(m, device, args.cpu, peers=True) for m in SIZES}
        else:
            figure = model_case(case, device, args.cpu)
        print(f"{case} ({time.perf_counter() - start:.0f} s): {figure}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
