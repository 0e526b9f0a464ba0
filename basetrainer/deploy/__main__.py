"""Command line: export a checkpoint, check every format against eager PyTorch, print the table.

    python -m basetrainer.deploy work_space/digits/model/last.pth --format onnx,mnn,ncnn,openvino \\
        --input-size 32 32 --check data/digits/val

Prints the markdown table, writes it and the JSON beside the exported files, and exits with 1
when any format failed its check or its conversion (2 for bad arguments).
"""
import argparse
import logging
import sys
from typing import List, Optional

from basetrainer.deploy.formats import FORMATS


def _indices(text: str) -> List[int]:
    if text.strip().lower() == "none":
        return []
    try:
        return [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give output indices (e.g. 0 or 0,2) or none") from None


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m basetrainer.deploy", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="weights file, last.pth (sharded too) or pruned_model.pth")
    parser.add_argument("--format", default="onnx", help=f"comma-separated, from {sorted(FORMATS)}")
    parser.add_argument("--input-size", nargs=2, type=int, metavar=("W", "H"), help="default: the run's input_size")
    parser.add_argument("--channels", type=int, help="the image's channels (default: the model's first layer's)")
    parser.add_argument("--check", help="validation ImageFolder the exports are checked on (default: random inputs)")
    parser.add_argument("--check-limit", type=int, help="check on at most this many of its images")
    parser.add_argument("--calibration", help="training ImageFolder for onnx-int8 (default: train/ beside --check)")
    parser.add_argument("--calibration-images", type=int, default=200, help="images int8 is calibrated on")
    parser.add_argument("--out-dir", help="default: export/ beside the checkpoint")
    parser.add_argument("--name", help="base name of the files (default: the checkpoint's)")
    parser.add_argument("--net-type", help="for a weights file whose run config is not found")
    parser.add_argument("--num-classes", type=int, help="also: outputs [N, num_classes] are class scores")
    parser.add_argument("--class-outputs", type=_indices, metavar="K[,K...]|none",
                        help="the outputs that hold class scores (top-1 and accuracy are checked on them only); "
                             "default: those with --num-classes (or the run's, or the check folder's) columns")
    parser.add_argument("--pruned", help="the run's prune/pruned_model.pth, for weights of a pruned model")
    parser.add_argument("--weights", default="model", choices=["model", "ema"], help="ema: ModelEMA's average")
    parser.add_argument("--mean", nargs=3, type=float, default=[0.5, 0.5, 0.5])
    parser.add_argument("--std", nargs=3, type=float, default=[0.5, 0.5, 0.5])
    parser.add_argument("--batch", type=int, default=37, help="batch N of the dynamic-batch check and the latency")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per latency figure (0: no timing)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, help="threads of every runtime and of eager PyTorch")
    parser.add_argument("--exporter", default="auto", choices=["auto", "dynamo", "torchscript"])
    parser.add_argument("--opset", type=int)
    parser.add_argument("--no-simplify", action="store_true", help="keep the ONNX graph as torch wrote it")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = get_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for chatty in ("onnxscript", "onnx_ir", "torch.onnx"):   # the dynamo exporter's pass-by-pass log
        logging.getLogger(chatty).setLevel(logging.WARNING)
    from basetrainer.deploy.export import ExportFailed, export_model
    from basetrainer.deploy.parity import ParityError

    try:
        report = export_model(args.checkpoint, args.format, out_dir=args.out_dir, input_size=args.input_size,
                              channels=args.channels,
                              net_type=args.net_type, num_classes=args.num_classes, pruned=args.pruned,
                              weights=args.weights, check=args.check, check_limit=args.check_limit,
                              calibration=args.calibration, calibration_images=args.calibration_images,
                              mean=args.mean, std=args.std, batch=args.batch, simplify=not args.no_simplify,
                              exporter=args.exporter, opset=args.opset, runs=args.runs, warmup=args.warmup,
                              threads=args.threads, name=args.name, class_outputs=args.class_outputs)
    except (ParityError, ExportFailed) as e:
        sys.stdout.write(e.report.to_markdown())   # type: ignore[attr-defined]
        sys.stderr.write(f"error: {e}\n")
        return 1
    except (ValueError, TypeError, OSError, ImportError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    sys.stdout.write(report.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
