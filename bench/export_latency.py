"""CPU inference latency of the exported formats against eager PyTorch, in one run.

Usage::

    python bench/export_latency.py                                   # the digits example's run
    python bench/export_latency.py --checkpoint work_space/digits/model/last.pth --check data/digits/val
    python bench/export_latency.py --net-type mobilenet_v2 --input-size 224 224 --runs 30

Every format is exported and checked against eager PyTorch first (a format outside its bound is
left out of the timing and marked), then eager PyTorch and the exports are timed interleaved:
each round runs every contender once, with an untimed pause before each call; the figure is the
median of ``--runs`` rounds after ``--warmup`` untimed ones, with the interquartile range. Eager
PyTorch is the reference row (1.00x). All runtimes get the same number of threads.
A CUDA ONNX Runtime row and a TensorRT row need an NVIDIA GPU; without one they are reported as
not run.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from basetrainer.deploy.export import export_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def table(report, batch: int) -> str:
    keys = ["batch 1", f"batch {batch}"]
    eager = next(r for r in report.rows if r.format == "pytorch")
    lines = [f"| format | precision | batch 1 ms (IQR) | vs eager | batch {batch} ms (IQR) | per image ms | "
             f"vs eager | max abs Δ | top-1 agree |", "|---|---|---|---|---|---|---|---|---|"]
    for row in report.rows:
        if not row.latency:
            lines.append(f"| {row.format} | {row.precision} | not timed: {row.status} | | | | | | |")
            continue
        cells = [row.format, row.precision]
        for k in keys:
            lat, ref = row.latency[k], eager.latency[k]
            cells.append(f"{lat['median_ms']:.2f} ({lat['q1_ms']:.2f}-{lat['q3_ms']:.2f})")
            if k != "batch 1":
                cells.append(f"{lat['median_ms'] / lat['batch']:.3f}")
            cells.append(f"{ref['median_ms'] / lat['median_ms']:.2f}x")
        p = row.parity or {}
        agreement = p.get("agreement")   # None: the model has no class-score output
        cells += [f"{p.get('max_abs', 0):.2g}", "-" if agreement is None else f"{agreement:.2%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "work_space" / "digits" / "model" / "last.pth"))
    parser.add_argument("--net-type", help="time a freshly built model of this type instead of a checkpoint")
    parser.add_argument("--input-size", nargs=2, type=int, default=None, metavar=("W", "H"))
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--check", default=str(ROOT / "data" / "digits" / "val"))
    parser.add_argument("--format", default="onnx,onnx-fp16,onnx-int8,mnn,ncnn,ncnn-fp16,openvino")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out-dir", default=str(ROOT / "output" / "export_latency"))
    args = parser.parse_args()
    if args.runs < 20:
        parser.error("--runs must be at least 20 (the median of fewer is not a figure to publish)")
    check = args.check if os.path.isdir(args.check) else None
    if args.net_type:
        from basetrainer.models.build_models import get_models

        size = args.input_size or [224, 224]
        source = get_models(args.net_type, size, args.num_classes).eval()
        name = args.net_type
    else:
        source, size, name = args.checkpoint, args.input_size, None
        if not os.path.isfile(source):
            parser.error(f"{source} does not exist: train the example first (python examples/example.py) "
                         f"or pass --checkpoint / --net-type")
    report = export_model(source, args.format, out_dir=args.out_dir, input_size=size, check=check,
                          runs=args.runs, warmup=args.warmup, batch=args.batch, threads=args.threads,
                          name=name, strict=False)
    text = [f"{report.source}, input {tuple(report.input_shape)}, checked on {report.checked_on}; "
            f"{args.threads} thread(s), torch {torch.__version__}", "", table(report, args.batch)]
    if not torch.cuda.is_available():
        text.append("CUDA ONNX Runtime and TensorRT: not run (no NVIDIA GPU on this machine).\n")
    text += [f"Note: {n}" for n in report.notes]
    sys.stdout.write("\n".join(text) + "\n")
    out = Path(args.out_dir) / "export_latency.json"
    out.write_text(json.dumps(report.as_dict(), indent=2, default=str) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
