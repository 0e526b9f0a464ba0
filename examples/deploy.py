"""Train the example classifier, then export its best model and print the deployment table.

It takes examples/example.py's flags (one process), trains, and exports the best weights to the
formats asked for, each checked against eager PyTorch on the validation images (int8 is
calibrated on training images). With --use_prune the model is pruned before training (as in
example.py) and the table gains the dense model's rows, so it shows the size and the latency
that pruning bought.

    python examples/deploy.py --export onnx,mnn,ncnn,openvino            # train, then export
    python examples/deploy.py --export onnx,onnx-int8 --use_prune --sparsity 0.5
    python examples/deploy.py --export_only --work_dir work_space/digits   # a run trained before
"""
import argparse
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import example  # noqa: E402  (examples/example.py: the trainer and its flags)

from basetrainer.runtime import errors  # noqa: E402


def best_weights(model_dir: str) -> str:
    found = sorted(glob.glob(os.path.join(model_dir, "best_model_*.pth")), key=os.path.getmtime)
    if not found:
        raise errors.PathError(f"no best_model_*.pth in {model_dir}: train first (drop --export_only)")
    return found[-1]


def export_run(cfg, formats: str, out_dir: str):
    from basetrainer.deploy.export import export_model

    weights = best_weights(os.path.join(cfg.work_dir, "model"))
    pruned = os.path.join(cfg.work_dir, "prune", "pruned_model.pth") if cfg.use_prune else None
    return export_model(weights, formats, out_dir=out_dir, input_size=cfg.input_size, net_type=cfg.net_type,
                        num_classes=len(cfg.classes) if cfg.get("classes") else None, pruned=pruned,
                        check=cfg.test_data, calibration=cfg.train_data, runs=0, strict=False)


def dense_reference(cfg, formats: str, out_dir: str):
    """The unpruned model of the same architecture (its weights do not matter for size and speed)."""
    from basetrainer.deploy.export import export_model
    from basetrainer.models import build_models

    dense = build_models.get_models(cfg.net_type, cfg.input_size, len(cfg.classes))
    formats = ",".join(f for f in formats.split(",") if f != "onnx-int8")   # int8's accuracy needs trained weights
    return export_model(dense, formats, out_dir=out_dir, input_size=cfg.input_size, check=cfg.test_data,
                        calibration=cfg.train_data, runs=0, name="dense", strict=False)


def pruning_summary(dense, pruned) -> str:
    lines = ["", "What pruning bought (dense -> pruned; median latency, batch 1 and batch N):", "",
             "| format | size | batch 1 ms | batch N ms |", "|---|---|---|---|"]
    for row in pruned.rows:
        other = next((r for r in dense.rows if r.format == row.format), None)
        if other is None or not row.latency or not other.latency or not row.size_bytes or not other.size_bytes:
            continue
        keys = sorted(row.latency)
        cells = [f"{other.size_bytes / 2**20:.1f} -> {row.size_bytes / 2**20:.1f} MB "
                 f"({row.size_bytes / other.size_bytes:.0%})"]
        for key in keys:
            a, b = other.latency[key]["median_ms"], row.latency[key]["median_ms"]
            cells.append(f"{a:.2f} -> {b:.2f} ({b / a:.0%})")
        lines.append(f"| {row.format} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--export", default="onnx,mnn,ncnn,openvino", help="formats, comma-separated")
    parser.add_argument("--export_only", action="store_true", help="export the run in work_dir; do not train")
    parser.add_argument("--export_runs", type=int, default=20, help="timed runs per latency figure")
    own, rest = parser.parse_known_args(argv)
    cfg = example.parse_config(rest)
    cfg.gpu_id, cfg.distributed = cfg.gpu_id[:1], False   # one process: the export follows in it
    if not own.export_only:
        example.main(cfg)
    if not cfg.get("classes"):
        from basetrainer.dataloader.image_folder import image_folder

        cfg.classes = image_folder(cfg.train_data, key="train_data").classes
    from basetrainer.deploy.export import time_reports

    out_dir = os.path.join(cfg.work_dir, "export")
    report = export_run(cfg, own.export, out_dir)
    dense = dense_reference(cfg, own.export, os.path.join(out_dir, "dense")) if cfg.use_prune else None
    if own.export_runs:   # the pruned and the dense exports timed in one interleaved loop
        time_reports([report] + ([dense] if dense else []), runs=own.export_runs)
    report.write(os.path.join(out_dir, "deploy.json"), os.path.join(out_dir, "deploy.md"))
    sys.stdout.write(report.to_markdown())
    ok = report.ok
    if dense is not None:
        sys.stdout.write("\nThe dense model (before pruning; untrained, for size and speed):\n\n" + dense.to_markdown())
        sys.stdout.write(pruning_summary(dense, report))
    if not ok:
        sys.stderr.write("export failed: " + "; ".join(f"{r.format}: {r.status}" for r in report.failed) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    with errors.exit_on_usage_error():   # a user error: "error: <message>", exit status 2, no traceback
        sys.exit(main())
