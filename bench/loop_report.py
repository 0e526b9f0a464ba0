"""Tables, docs/benchmarks.md and docs/benchmarks.png for ``bench_loop.py``."""
import datetime
import math
import os
import platform
import statistics
import subprocess
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS_TOLERANCE = 1e-6
IMPORT_TARGET_S = 0.1
DDP_THROUGHPUT_FLOOR = 0.95


def machine_info(threads: int) -> Dict[str, Any]:
    """CPU model and count, torch/torchvision/Python versions, date, load and library state."""
    import torch
    import torchvision

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "basetrainer"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        library = f"{commit}{' + uncommitted changes in basetrainer/' if dirty else ''}" if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        library = "unknown"
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "python": platform.python_version(), "threads": threads, "library": library,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "load_start": load_average()}


def load_average() -> float:
    """The 1-minute load average (nan where unknown)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def case_row(name: str, case: Dict[str, Any]) -> Dict[str, Any]:
    """The derived figures of one loop comparison (medians, ratios, per-step overhead)."""
    b_med, h_med = statistics.median(case["b"]), statistics.median(case["h"])
    ratio = statistics.median(case["ratios"])
    target = case["target"]
    return {
        "case": name, "steps": case["steps"], "repeats": len(case["b"]),
        "b_ms": b_med * 1e3, "h_ms": h_med * 1e3,
        "b_sps": case["samples"] / b_med, "h_sps": case["samples"] / h_med,
        "ratio": ratio, "ratio_best": min(case["b"]) / min(case["h"]),
        "ratio_lo": min(case["ratios"]), "ratio_hi": max(case["ratios"]),
        "overhead_us": (b_med - h_med) / case["steps"] * 1e6,
        "target": target, "meets": ratio <= target,
        "loss_diff": case["loss_diff"], "weight_diff": case["weight_diff"],
        "outside_s": statistics.median(case["b_outside"]), "load": case["load"],
    }


def findings(results: Dict[str, Any]) -> str:
    """A few generated sentences: which targets are missed and where the time goes."""
    lines = []
    missed = [t for t in targets(results) if not t["meets"]]
    if not missed:
        lines.append("Every target is met in this run.")
    else:
        lines.append("Missed in this run: " + "; ".join(f"{t['target']} (measured {t['measured']})" for t in missed)
                     + ".")
    costs = results.get("costs", {})
    for name, case in results.get("cases", {}).items():
        if name not in costs:
            continue
        row = case_row(name, case)
        extra_ms = row["b_ms"] - row["h_ms"]
        inside = [(k, v) for k, v in costs[name]["handlers"].items()
                  if k.split(".")[-1] not in ("on_train_begin", "on_train_end")]
        epochs = max(1e-9, costs[name]["epochs_s"])
        top = ", ".join(f"{k} {100 * v['total_s'] / epochs:.1f}%" for k, v in inside[:3])
        lines.append(f"`{name}`: basetrainer's epoch is {extra_ms:.0f} ms ({100 * (row['ratio'] - 1):.1f}%) longer "
                     f"than the hand loop's; the largest callback shares of the epoch: {top}.")
    return "\n\n".join(lines)


def _fmt_diff(v: float) -> str:
    return "n/a" if v != v else f"{v:.1e}"


def _table(header: Sequence[str], rows: List[Sequence[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def loop_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """The loop comparisons, one row per case."""
    header = ["case", "steps/epoch", "basetrainer ms/epoch", "hand ms/epoch", "basetrainer samples/s",
              "hand samples/s", "ratio B/H (median)", "ratio (best runs)", "paired range", "target", "meets",
              "overhead us/step", "max |dloss|", "max |dweight|", "load"]
    if not results.get("cases"):
        return ""
    rows = []
    for name, case in results["cases"].items():
        r = case_row(name, case)
        rows.append([name, str(r["steps"]), f"{r['b_ms']:.1f}", f"{r['h_ms']:.1f}", f"{r['b_sps']:.0f}",
                     f"{r['h_sps']:.0f}", f"{r['ratio']:.3f}", f"{r['ratio_best']:.3f}",
                     f"{r['ratio_lo']:.3f}-{r['ratio_hi']:.3f}", f"<= {r['target']:.3f}",
                     "yes" if r["meets"] else "NO", f"{r['overhead_us']:.0f}", _fmt_diff(r["loss_diff"]),
                     _fmt_diff(r["weight_diff"]), f"{r['load']:.1f}"])
    return _table(header, rows, markdown)


def import_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """Import cost beyond ``import torch, torchvision``."""
    imports = results.get("imports")
    if not imports:
        return ""
    header = ["import", "extra time, in process (median)", "extra wall time, fresh process (median)", "target",
              "meets"]
    rows = [["import torch, torchvision (baseline)", "-", f"{imports['baseline']['wall_s'] * 1e3:.0f} ms total",
             "-", "-"]]
    for name, v in imports.items():
        if name == "baseline":
            continue
        is_target = name == "import basetrainer"
        rows.append([name, f"{v['inproc_s'] * 1e3:.1f} ms",
                     f"{v['wall_s'] * 1e3:+.0f} ms (rounds: {v['wall_lo_s'] * 1e3:+.0f} to {v['wall_hi_s'] * 1e3:+.0f})",
                     f"<= {IMPORT_TARGET_S * 1e3:.0f} ms" if is_target else "-",
                     ("yes" if v["inproc_s"] <= IMPORT_TARGET_S else "NO") if is_target else "-"])
    return _table(header, rows, markdown)


def data_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """Images/s of the example's training loader."""
    data = results.get("data")
    if not data:
        return ""
    header = ["num_workers", "images/pass", "first pass (incl. worker start) images/s", "second pass images/s"]
    rows = [[str(w), str(v["images"]), f"{v['first']:.0f}", f"{v['second']:.0f}"] for w, v in data.items()]
    return _table(header, rows, markdown)


def costs_table(results: Dict[str, Any], markdown: bool = False, top: int = 8) -> str:
    """Where the callbacks' time goes, per case (the largest handlers)."""
    costs = results.get("costs")
    if not costs:
        return ""
    header = ["case", "callback.event", "calls", "total ms", "us/call", "% of epochs"]
    rows = []
    for case, entry in costs.items():
        for key, v in list(entry["handlers"].items())[:top]:
            rows.append([case, key, str(v["calls"]), f"{v['total_s'] * 1e3:.1f}",
                         f"{v['total_s'] / max(v['calls'], 1) * 1e6:.1f}",
                         "(outside)" if key.split(".")[-1] in ("on_train_begin", "on_train_end")
                         else f"{100 * v['total_s'] / entry['epochs_s']:.2f}"])
    return _table(header, rows, markdown)


RELEVANT = {"accuracy": "AccuracyRecorder.on_train_summary", "lr": "LRSchedulerCallback.on_batch_prepare",
            "loss": "LossesRecorder.on_train_summary", "checkpoint": "ModelCheckpoint.on_epoch_end",
            "durable": "ModelCheckpoint.on_epoch_end"}


def whatif_rows(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per patched handler: cost as is and patched, and the saving per epoch of its case."""
    rows = []
    for name, w in (results.get("whatif") or {}).items():
        by_handler: Dict[str, List[str]] = {}
        for patch in w["patches"]:
            by_handler.setdefault(RELEVANT[patch], []).append(patch)
        for key, chosen in by_handler.items():
            h = w["handlers"].get(key)
            if h is None:
                continue
            per_step = key.endswith(("on_train_summary", "on_batch_prepare"))
            cases = results.get("cases", {})
            calls = cases[name]["steps"] if name in cases and per_step else h["calls_per_epoch"]
            rows.append({"case": name, "patch": "+".join(chosen), "handler": key, "as_is_us": h["as_is_us"],
                         "patched_us": h["patched_us"], "calls": calls,
                         "saved_ms": (h["as_is_us"] - h["patched_us"]) * calls / 1e3,
                         "weight_diff": w["weight_diff"], "loss_diff": w["loss_diff"]})
    return rows


def whatif_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """Handler costs as is and with the suggested changes, and the projected loop ratio."""
    rows = whatif_rows(results)
    if not rows:
        return ""
    header = ["case", "change", "handler", "calls/epoch", "as is us/call", "patched us/call", "saved ms/epoch",
              "ratio as measured", "ratio projected", "max |dloss|, |dweight| patched vs as is"]
    out = []
    saved_by_case: Dict[str, float] = {}
    for r in rows:
        saved_by_case[r["case"]] = saved_by_case.get(r["case"], 0.0) + r["saved_ms"]
    for r in rows:
        case = results.get("cases", {}).get(r["case"])
        measured = projected = "-"
        if case is not None:
            row = case_row(r["case"], case)
            measured = f"{row['ratio']:.3f}"
            projected = f"{row['ratio'] - saved_by_case[r['case']] / row['h_ms']:.3f} (all changes)"
        out.append([r["case"], r["patch"], r["handler"], f"{r['calls']:.0f}", f"{r['as_is_us']:.1f}",
                    f"{r['patched_us']:.1f}", f"{r['saved_ms']:.2f}", measured, projected,
                    f"{_fmt_diff(r['loss_diff'])}, {_fmt_diff(r['weight_diff'])}"])
    return _table(header, out, markdown)


def epoch_whatif_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """Whole-epoch times of basetrainer with each set of suggested changes, against H."""
    data = results.get("whatif_epochs")
    if not data:
        return ""
    header = ["case", "variant", "ms/epoch (median)", "ratio to hand (median)", "ratio (best runs)"]
    rows = []
    for case, entry in data.items():
        runs = entry["runs"]
        hand = runs["hand"]
        for name, xs in runs.items():
            ratio = statistics.median([x / y for x, y in zip(xs, hand)])
            rows.append([case, name, f"{statistics.median(xs) * 1e3:.1f}", f"{ratio:.3f}",
                         f"{min(xs) / min(hand):.3f}"])
    return _table(header, rows, markdown)


def targets(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every target with its measured figure and whether it is met."""
    out = []
    cases = results.get("cases", {})
    for name, case in cases.items():
        r = case_row(name, case)
        out.append({"target": f"{name}: epoch-time ratio <= {r['target']:.2f}", "measured": f"{r['ratio']:.3f}",
                    "meets": r["meets"]})
        if case.get("world", 1) > 1:
            throughput = 1.0 / r["ratio"]
            out.append({"target": f"{name}: throughput >= {DDP_THROUGHPUT_FLOOR:.2f}x hand-written",
                        "measured": f"{throughput:.3f}x", "meets": throughput >= DDP_THROUGHPUT_FLOOR})
    checked = [(n, c) for n, c in cases.items() if not math.isnan(c["loss_diff"])]
    if checked:
        worst = max(c["loss_diff"] for _, c in checked)
        out.append({"target": f"loss per epoch equal within {LOSS_TOLERANCE:g} ({len(checked)} cases)",
                    "measured": f"max {worst:.1e}", "meets": worst <= LOSS_TOLERANCE})
    imports = results.get("imports")
    if imports:
        v = imports["import basetrainer"]
        out.append({"target": f"import basetrainer <= {IMPORT_TARGET_S:g} s beyond torch+torchvision",
                    "measured": f"{v['inproc_s'] * 1e3:.1f} ms in process ({v['wall_s'] * 1e3:+.0f} ms wall, noisy)",
                    "meets": v["inproc_s"] <= IMPORT_TARGET_S})
    return out


def targets_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """One row per target: what it asks, the measured figure, met or not."""
    rows = [[t["target"], t["measured"], "yes" if t["meets"] else "NO"] for t in targets(results)]
    return _table(["target", "measured", "meets"], rows, markdown) if rows else ""


def text_report(results: Dict[str, Any]) -> str:
    """Everything, as plain-text tables for the console."""
    parts = []
    for title, table in (("Loop: basetrainer (B) vs hand-written PyTorch (H)", loop_table(results)),
                         ("Targets", targets_table(results)),
                         ("Import time beyond torch + torchvision", import_table(results)),
                         ("examples/example.py train loader (digits ImageFolder)", data_table(results)),
                         ("Callback cost (one instrumented run)", costs_table(results)),
                         ("What if: suggested library changes, monkeypatched in", whatif_table(results)),
                         ("What if, whole epochs", epoch_whatif_table(results))):
        if table:
            parts.append(f"{title}\n{table}")
    return "\n\n".join(parts)


def write_markdown(path: str, results: Dict[str, Any], command: str, canonical: str) -> None:
    """docs/benchmarks.md: machine, method, tables, targets.

    Args:
        path: the file to write.
        results: what ``bench_loop.main`` gathered.
        command: the command that produced ``results``.
        canonical: the command that refreshes the page.
    """
    info = results["machine"]
    specs = results.get("specs", {})
    spec_lines = "\n".join(f"- `{n}`: {s}" for n, s in specs.items())
    extra = "".join(f"; also from {c}" for c in results.get("extra_commands", []))
    text = f"""# Benchmarks

basetrainer's loop against a hand-written PyTorch loop doing the same work. Refresh with

    {canonical}

(`--quick` for a short run, `--cases` to pick cases; `bench/bench_loop.py --help`). The
figures below come from `{command}`{" (a quick run: fewer, shorter repeats)" if results.get("quick") else ""}{extra}.

## Machine

| | |
|---|---|
| CPU | {info['cpu']} |
| cores | {info['cores']} |
| torch threads per process | {info['threads']} |
| torch / torchvision / Python | {info['torch']} / {info['torchvision']} / {info['python']} |
| library state | {info['library']} |
| date | {info['date']} |
| load average (1 min) at start / end | {info['load_start']:.1f} / {results.get('load_end', float('nan')):.1f} |
| run time of this benchmark | {results.get('total_s', 0.0):.0f} s |

## Loop overhead

{loop_table(results, markdown=True)}

![ratios](benchmarks.png)

How it is measured:

- The same model (initial weights from one state_dict), the same in-memory `TensorDataset`, the
  same order (`DistributedSampler(num_replicas=world, rank=rank, shuffle=True, seed=2020)` with
  `set_epoch` every epoch, as `build_dataloader` builds it), SGD (lr 0.05, momentum 0.9,
  weight decay 5e-4), cross-entropy, batch size global.
- The two contenders alternate in one process (B, H, H, B, B, H, ...; DDP: inside one 2-process gloo
  group started by `basetrainer.engine.launch.launch`, one torch thread per process). An untimed
  pair first warms both up and checks equality (with callbacks off, basetrainer gets a
  LossesRecorder for that pair only). Single-process cases use {info['threads']} torch thread(s):
  on a 2-core machine shared with other jobs, two intra-op threads make epoch times swing by
  several times. *ratio B/H (median)* is the median over repeats
  of the paired ratio of the run's epoch time; *ratio (best runs)* is the fastest B run over
  the fastest H run (the least disturbed by other load); *overhead us/step* = (median B - median
  H) / steps per epoch.
- An epoch runs from just before `set_epoch` to the end of the epoch (basetrainer: after the last
  `on_epoch_end`); a run's epoch time is (last end - first start) / epochs. Trainer
  construction and `on_train_begin`/`on_train_end` (TensorBoard writer, `history.png`) are outside
  (median {_outside(results)}).
- Callbacks off: basetrainer has no callback and progress off; the hand loop tracks nothing.
  Callbacks on: AccuracyRecorder, LossesRecorder, the `constant` schedule of
  `build_scheduler.get_scheduler` (per-step LR callback; constant so that training is unchanged),
  LogHistory (log_freq 50, TensorBoard on, lines to a file), ModelCheckpoint (every epoch:
  `last.pth`, `model_<epoch>.pth`, `best_model_*.pth`, to a temp folder); the hand loop keeps its
  sample-weighted epoch loss on the device and reads it once per epoch. Progress bars are off in
  both settings.
- *max |dloss|*: per-epoch `history["train/loss"]` (LossesRecorder) against the hand loop's
  sample-weighted epoch loss, over every compared run; *max |dweight|*: final weights.

Cases:

{spec_lines}

## Targets

{targets_table(results, markdown=True)}

{findings(results)}

## Import time

{import_table(results, markdown=True)}

*In process*: the import statement timed inside an interpreter that already imported torch and
torchvision. *Fresh process*: wall time of `python -c "import torch, torchvision; <import>"`
minus that of `python -c "import torch, torchvision"` in the same round (start-up noise of
tens of ms on a busy machine).

## Data loading: examples/example.py's pipeline

{data_table(results, markdown=True)}

The digits ImageFolder (data/digits/train, made by `examples/prepare_data.prepare_digits`) with
`ClassificationTrainer.transforms(train=True)` (Resize to 32x32, RandomAffine, ToTensor,
Normalize), batch 32, loaded through `build_dataloader(phase="train", drop_last=True)`.

## Where the callbacks' time goes

{costs_table(results, markdown=True) or "(not run)"}

One instrumented run per case: each handler is timed (the wrapper adds about 1 us per call);
*% of epochs* is its share of the run's epoch time; `on_train_begin`/`on_train_end` are outside
the epochs.

## What if: cheaper hot-path callbacks (monkeypatched in the benchmark, library untouched)

{whatif_table(results, markdown=True) or "(not run)"}

{epoch_whatif_table(results, markdown=True) or "(whole-epoch variant: `--cases whatif_epochs`, not part of the default run)"}

The changes (bench/loop_patches.py): *accuracy*: AccuracyRecorder keeps each step's targets and
argmax and folds them into the confusion matrix when a figure is read, instead of 6-7 small
tensor ops per step; *lr*: the LR callback sets `param_group["lr"]` from `lr_factor(step)`
instead of `warnings.catch_warnings()` + `LambdaLR.step()` per step; *loss*: LossesRecorder adds
in place; *durable*: only `last.pth` is fsynced (the weights-only files `model_*.pth` keep temp
file + rename, whole after any process crash); *async*: checkpoint files are serialised,
written and fsynced by a background thread from a copy of the tensors (waited for in
`on_train_end`). Every patched run ends with the same
weights and losses as the unpatched one (last column). *ratio projected* subtracts the saved
handler time from the measured epoch ratio.
"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _outside(results: Dict[str, Any]) -> str:
    parts = [f"{n}: {statistics.median(c['b_outside']):.2f} s" for n, c in results.get("cases", {}).items()]
    return ", ".join(parts) if parts else "n/a"


def write_png(path: str, results: Dict[str, Any]) -> Optional[str]:
    """A bar chart of the B/H ratios with their targets, and the import cost with its target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [case_row(n, c) for n, c in results.get("cases", {}).items()]
    imports = results.get("imports")
    panels = (1 if rows else 0) + (1 if imports else 0)
    if not panels:
        return None
    fig, axes = plt.subplots(1, panels, figsize=(7.5 if panels == 1 else 11.5, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1.3][:panels]})
    ax_list = list(axes[0])
    if rows:
        ax = ax_list.pop(0)
        xs = range(len(rows))
        colors = ["tab:green" if r["meets"] else "tab:red" for r in rows]
        lows = [r["ratio"] - r["ratio_lo"] for r in rows]
        highs = [r["ratio_hi"] - r["ratio"] for r in rows]
        ax.bar(xs, [r["ratio"] for r in rows], color=colors, alpha=0.8, yerr=[lows, highs], capsize=4)
        for x, r in zip(xs, rows):
            ax.hlines(r["target"], x - 0.42, x + 0.42, colors="black", linestyles="--", linewidth=1.5)
            ax.text(x, r["ratio_hi"] + 0.004, f"{r['ratio']:.3f}", ha="center", va="bottom", fontsize=9)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["case"] for r in rows], rotation=15)
        top = max(max(r["ratio_hi"] for r in rows), max(r["target"] for r in rows))
        bottom = min(min(r["ratio_lo"] for r in rows), 1.0)
        ax.set_ylim(bottom - 0.03, top + 0.03)
        ax.set_ylabel("epoch time basetrainer / hand-written")
        ax.set_title("Loop overhead (median of paired runs; bars: range; dashed: target)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if imports:
        ax = ax_list.pop(0)
        names = [n for n in imports if n != "baseline"]
        values = [imports[n]["inproc_s"] * 1e3 for n in names]
        ax.bar(range(len(names)), values, color="tab:blue", alpha=0.8)
        ax.axhline(IMPORT_TARGET_S * 1e3, color="black", linestyle="--", linewidth=1.5,
                   label="target for import basetrainer")
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace("from basetrainer.engine import ", "engine.") for n in names], rotation=15,
                           fontsize=8)
        ax.set_ylabel("ms beyond import torch, torchvision")
        ax.set_title("Import time (in process)", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
