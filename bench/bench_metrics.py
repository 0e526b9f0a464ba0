"""What a metric recorder costs per training step.

    .venv/bin/python bench/bench_metrics.py            # everything (a few minutes on 2 cores)
    .venv/bin/python bench/bench_metrics.py --quick    # a short run

Three measurements, printed as tables (``--json PATH`` also writes them):

- ``loop``: basetrainer's loop (bench_loop's tiny CNN, batch 64, 10 classes, 100 steps/epoch,
  one torch thread) with no recorder and with one recorder each; runs alternate, the median
  epoch time over the repeats (and the best, less disturbed by other jobs on shared cores) is
  divided by the steps; the ratio is against no recorder. A recorder costs about its
  ``summary`` figure per step, which on a busy machine is below the loop's run-to-run noise.
- ``summary``: the recorder's own ``on_train_summary`` per step (µs), on fixed logits of
  ``[64, 10]``, a running figure read every 50 steps as the loop does: AccuracyRecorder's
  confusion counts against torchmetrics' MulticlassAccuracy in a MetricRecorder.
- ``imports``: ``import torchmetrics`` after ``import torch, torchvision`` (ms, median of
  fresh interpreters), against ``import basetrainer.metric.accuracy_recorder``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import torch  # noqa: E402

import loop_contenders as lc  # noqa: E402
from basetrainer.metric.accuracy_recorder import AccuracyRecorder  # noqa: E402
from basetrainer.metric.metric_recorder import FunctionRecorder, MetricRecorder  # noqa: E402

NUM_CLASSES = lc.NUM_CLASSES


def recorders() -> Dict[str, Callable[[], Any]]:
    """The recorder of each loop case (None: no recorder)."""
    from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

    return {
        "none": lambda: None,
        "AccuracyRecorder": lambda: AccuracyRecorder(),
        "MetricRecorder(MulticlassAccuracy)": lambda: MetricRecorder(MulticlassAccuracy(NUM_CLASSES), "acc"),
        "MetricRecorder(MulticlassAccuracy, validate_args=False)":
            lambda: MetricRecorder(MulticlassAccuracy(NUM_CLASSES, validate_args=False), "acc"),
        "MetricRecorder(MulticlassJaccardIndex)": lambda: MetricRecorder(MulticlassJaccardIndex(NUM_CLASSES), "IoU"),
        "FunctionRecorder(hit)": lambda: FunctionRecorder(lambda o, t: (o.argmax(1) == t).float(), "hit"),
    }


def bench_loop(repeats: int, steps: int) -> Dict[str, Any]:
    spec = lc.Spec("tiny_cnn", 64 * steps, 64, 1, callbacks=False)
    dataset, state = lc.make_dataset(spec), lc.initial_state(spec)
    makers = recorders()
    times: Dict[str, List[float]] = {name: [] for name in makers}
    for name, make in makers.items():   # warm-up (first-call costs)
        run_once(spec, dataset, state, make)
    for _ in range(repeats):            # alternate the cases, so a busy moment hits them all
        for name, make in makers.items():
            times[name].append(run_once(spec, dataset, state, make))
    base = statistics.median(times["none"])
    best = min(times["none"])
    return {name: {"us_per_step": 1e6 * statistics.median(t) / steps, "ratio": statistics.median(t) / base,
                   "best_us_per_step": 1e6 * min(t) / steps, "best_ratio": min(t) / best}
            for name, t in times.items()}


def run_once(spec: Any, dataset: Any, state: Any, make: Callable[[], Any]) -> float:
    recorder = make()

    def patch(trainer: Any) -> None:
        if recorder is not None:
            trainer.callbacks.insert(0, recorder)

    return lc.run_basetrainer(spec, dataset, state, 1, callbacks="none", patch=patch).run_epoch_s


def bench_summary(steps: int) -> Dict[str, float]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, NUM_CLASSES, generator=g)
    inputs = (torch.zeros(64, 3, 8, 8), torch.randint(0, NUM_CLASSES, (64,), generator=g))
    out = {}
    for name, make in recorders().items():
        if name == "none" or "JaccardIndex" in name:
            continue
        rec = make()
        rec.set_trainer(SimpleNamespace(should_log=lambda b: (b + 1) % 50 == 0, train_loader=object(),
                                        test_loader=None, model=None, device=torch.device("cpu"), phase="train"))
        logs: Dict[str, Any] = {}
        rec.on_train_begin(logs)
        rec.on_epoch_begin(0, logs)
        for b in range(50):   # warm-up
            rec.on_train_summary(inputs, logits, None, 0, b, logs)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for b in range(steps):
                rec.on_train_summary(inputs, logits, None, 0, b, logs)
            best = min(best, (time.perf_counter() - t0) / steps)
        out[name] = 1e6 * best
    return out


def bench_imports(repeats: int) -> Dict[str, float]:
    def fresh(module: str) -> float:
        code = (f"import time, torch, torchvision\nt = time.perf_counter()\nimport {module}\n"
                f"print(time.perf_counter() - t)")
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    cwd=ROOT).stdout)

    return {m: 1e3 * statistics.median(fresh(m) for _ in range(repeats))
            for m in ("torchmetrics", "basetrainer.metric.accuracy_recorder", "basetrainer.metric.metric_recorder")}


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on shared cores)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats, steps = (3, 30) if args.quick else (11, 100)
    results = {"loop": bench_loop(repeats, steps), "summary": bench_summary(200 if args.quick else 1000),
               "imports": bench_imports(3 if args.quick else 5)}
    print(f"loop: tiny CNN, batch 64, {steps} steps/epoch, median of {repeats} alternated runs, "
          f"{args.threads} thread(s)")
    print(f"  {'recorder':58s} {'µs/step':>9s} {'ratio':>7s} {'best µs':>9s} {'ratio':>7s}")
    for name, r in results["loop"].items():
        print(f"  {name:58s} {r['us_per_step']:9.0f} {r['ratio']:7.3f} {r['best_us_per_step']:9.0f} "
              f"{r['best_ratio']:7.3f}")
    print("on_train_summary alone, logits [64, 10], a figure read every 50 steps (best of 5):")
    for name, us in results["summary"].items():
        print(f"  {name:58s} {us:9.1f} µs")
    print("import after torch + torchvision (median of fresh interpreters):")
    for name, ms in results["imports"].items():
        print(f"  {name:58s} {ms:9.0f} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
