"""CPU inference latency of dense vs structurally pruned torchvision models.

Usage::

    python bench/prune_latency.py                      # resnet18 + mobilenet_v2, batch 8, 224x224
    python bench/prune_latency.py --batch 1 --runs 30 --prune-type fpgm --threads 2

For each model: prune a copy with :func:`basetrainer.pruning.nni_pruning.model_pruning`, then
time ``--runs`` forward passes of each, interleaved (after ``--warmup`` untimed ones), under
``torch.inference_mode()`` and print the medians, with the parameter / MAC ratios
(pruned / dense, MACs per sample) and the latency ratio pruned / dense.
"""
import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from basetrainer.pruning.counter import profile_model  # noqa: E402
from basetrainer.pruning.nni_pruning import model_pruning  # noqa: E402


def _forward_ms(model: nn.Module, inputs: torch.Tensor) -> float:
    start = time.perf_counter()
    model(inputs)
    return (time.perf_counter() - start) * 1000.0


def median_latencies_ms(models: List[nn.Module], inputs: torch.Tensor, runs: int,
                        warmup: int) -> List[float]:
    """Median wall time of one forward pass of each model, in milliseconds.

    The models are timed in turn within every run (interleaved), so a burst of load from other
    processes slows all of them alike instead of skewing the ratio.
    """
    times: List[List[float]] = [[] for _ in models]
    with torch.inference_mode():
        for model in models:
            model.eval()
            for _ in range(warmup):
                model(inputs)
        for _ in range(runs):
            for model, record in zip(models, times):
                record.append(_forward_ms(model, inputs))
    return [statistics.median(record) for record in times]


def bench_model(name: str, args: argparse.Namespace, workdir: Path) -> Dict[str, float]:
    """Prune ``name`` and time the dense and pruned models; returns the table row."""
    torch.manual_seed(0)
    dense = getattr(torchvision.models, name)(num_classes=args.num_classes).eval()
    pruned = model_pruning(copy.deepcopy(dense), [args.size, args.size], sparsity=args.sparsity,
                           prune_type=args.prune_type, output_prune=str(workdir / name))
    one = torch.randn(1, 3, args.size, args.size)
    cost_dense, cost_pruned = profile_model(dense, one), profile_model(pruned, one)
    batch = torch.randn(args.batch, 3, args.size, args.size)
    dense_ms, pruned_ms = median_latencies_ms([dense, pruned], batch, args.runs, args.warmup)
    return {"dense_ms": dense_ms, "pruned_ms": pruned_ms,
            "params_ratio": cost_pruned.params / cost_dense.params,
            "macs_ratio": cost_pruned.macs / cost_dense.macs,
            "latency_ratio": pruned_ms / dense_ms}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--prune-type", default="l1")
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}x3x"
          f"{args.size}x{args.size}, {args.prune_type} sparsity {args.sparsity}, median of "
          f"{args.runs} runs after {args.warmup} warm-up")
    header = (f"{'model':<14}{'params':>9}{'MACs':>9}{'dense ms':>11}{'pruned ms':>11}"
              f"{'latency':>9}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            row = bench_model(name, args, Path(tmp))
            print(f"{name:<14}{row['params_ratio']:>9.1%}{row['macs_ratio']:>9.1%}"
                  f"{row['dense_ms']:>11.1f}{row['pruned_ms']:>11.1f}{row['latency_ratio']:>9.1%}")
    print("params / MACs / latency columns are pruned / dense")
    return 0


if __name__ == "__main__":
    sys.exit(main())
