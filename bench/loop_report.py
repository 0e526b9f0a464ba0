"""Derived figures and tables of ``bench_loop.py`` (plain text or markdown), and its targets."""
import datetime
import math
import os
import platform
import statistics
import subprocess
from typing import Any, Dict, List, Sequence

import loop_stats

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
    """The derived figures of one loop comparison: CPU time (the gate's figure: paired median
    ratio and overhead per step, each with a bootstrap 95% interval) and wall time (median
    ratio and the range of the pairs)."""
    b_med, h_med = statistics.median(case["b"]), statistics.median(case["h"])
    wall = loop_stats.paired(case["b"], case["h"], case["steps"])
    cpu = loop_stats.paired(case["b_cpu"], case["h_cpu"], case["steps"])
    target = case["target"]
    return {
        "case": name, "setup": case.get("setup", "-"), "steps": case["steps"], "repeats": len(case["b"]),
        "b_ms": b_med * 1e3, "h_ms": h_med * 1e3,
        "b_sps": case["samples"] / b_med, "h_sps": case["samples"] / h_med,
        "ratio": wall["ratio"], "ratio_best": min(case["b"]) / min(case["h"]),
        "ratio_lo": wall["min"], "ratio_hi": wall["max"], "wall_ci": (wall["ratio_lo"], wall["ratio_hi"]),
        "overhead_us": wall["overhead_us"],
        "b_cpu_us": loop_stats.per_step_us(case["b_cpu"], case["steps"]),
        "h_cpu_us": loop_stats.per_step_us(case["h_cpu"], case["steps"]),
        "cpu_ratio": cpu["ratio"], "cpu_ratio_lo": cpu["ratio_lo"], "cpu_ratio_hi": cpu["ratio_hi"],
        "cpu_overhead_us": cpu["overhead_us"], "cpu_overhead_lo": cpu["overhead_lo"],
        "cpu_overhead_hi": cpu["overhead_hi"], "cpu_min": cpu["min"], "cpu_max": cpu["max"],
        "target": target, "meets": cpu["ratio"] <= target,
        "loss_diff": case["loss_diff"], "weight_diff": case["weight_diff"],
        "outside_s": statistics.median(case["b_outside"]), "load": case["load"],
    }


def claim(r: Dict[str, Any]) -> str:
    """'overhead N us per step (CPU time), ratio R [lo-hi]'."""
    return (f"overhead {r['cpu_overhead_us']:.0f} us per step (CPU time; 95% interval {r['cpu_overhead_lo']:.0f} to "
            f"{r['cpu_overhead_hi']:.0f}), ratio {r['cpu_ratio']:.3f} [{r['cpu_ratio_lo']:.3f}-{r['cpu_ratio_hi']:.3f}]")


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
        extra_ms = row["b_ms"] - row["h_ms"]   # wall time: the callbacks' costs below are wall times too
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
        def cells(values: Sequence[str]) -> str:
            return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"
        lines = [cells(header), "|" + "|".join("---" for _ in header) + "|"] + [cells(r) for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def loop_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """The loop comparisons in CPU time, one row per case."""
    header = ["case", "basetrainer gets", "steps/epoch", "B CPU us/step", "H CPU us/step",
              "overhead us/step [95%]", "ratio B/H [95%]", "paired range", "round medians", "target", "meets",
              "max |dloss|", "max |dweight|", "pairs"]
    if not results.get("cases"):
        return ""
    rows = []
    for name, case in results["cases"].items():
        r = case_row(name, case)
        rows.append([name, r["setup"], str(r["steps"]), f"{r['b_cpu_us']:.0f}", f"{r['h_cpu_us']:.0f}",
                     f"{r['cpu_overhead_us']:.0f} [{r['cpu_overhead_lo']:.0f}, {r['cpu_overhead_hi']:.0f}]",
                     f"{r['cpu_ratio']:.3f} [{r['cpu_ratio_lo']:.3f}, {r['cpu_ratio_hi']:.3f}]",
                     f"{r['cpu_min']:.3f}-{r['cpu_max']:.3f}",
                     " ".join(f"{m:.3f}" for m in case.get("round_cpu_medians", [])) or "-",
                     f"<= {r['target']:.2f}", "yes" if r["meets"] else "NO", _fmt_diff(r["loss_diff"]),
                     _fmt_diff(r["weight_diff"]), str(r["repeats"])])
    return _table(header, rows, markdown)


def wall_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """The same comparisons in wall time (reported with their spread; not a gate)."""
    header = ["case", "B ms/epoch", "H ms/epoch", "B samples/s", "H samples/s", "ratio B/H [95%]", "paired range",
              "ratio (best runs)", "overhead us/step", "round medians", "load"]
    if not results.get("cases"):
        return ""
    rows = []
    for name, case in results["cases"].items():
        r = case_row(name, case)
        rows.append([name, f"{r['b_ms']:.1f}", f"{r['h_ms']:.1f}", f"{r['b_sps']:.0f}", f"{r['h_sps']:.0f}",
                     f"{r['ratio']:.3f} [{r['wall_ci'][0]:.3f}, {r['wall_ci'][1]:.3f}]",
                     f"{r['ratio_lo']:.3f}-{r['ratio_hi']:.3f}", f"{r['ratio_best']:.3f}", f"{r['overhead_us']:.0f}",
                     " ".join(f"{m:.3f}" for m in case.get("round_medians", [])) or "-", f"{r['load']:.1f}"])
    return _table(header, rows, markdown)


def seeding_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """Per-sample seeding's CPU time per item and per batch (the ``seeding`` probe)."""
    seeding = results.get("seeding")
    if not seeding:
        return ""
    header = ["data set", "per item (us)", "per batch (us)", "extra per batch, by batch size (us)"]
    rows = [[name, f"{v['per_item_us']:.2f}", f"{v['per_batch_us']:.1f}",
             ", ".join(f"{b}: {x:.1f}" for b, x in v["extra_us"].items())] for name, v in seeding.items()]
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
    header = ["num_workers", "per-sample seeding", "images/pass", "first pass (incl. worker start) images/s",
              "second pass images/s", "seeded / unseeded (second pass)"]
    rows = []
    for name, v in data.items():
        workers, _, unseeded = str(name).partition("-")
        other = data.get(f"{workers}-unseeded") if not unseeded else None
        ratio = f"{v['second'] / other['second']:.3f}" if other else "-"
        rows.append([workers, "off" if unseeded else "on", str(v["images"]), f"{v['first']:.0f}",
                     f"{v['second']:.0f}", ratio])
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


def writes_table(results: Dict[str, Any], markdown: bool = False) -> str:
    """What resnet18_on's epoch-end checkpoint costs the training (``writes`` probe)."""
    w = results.get("writes")
    if not w:
        return ""
    epoch = None
    for name in ("resnet18_on", "resnet18_off"):
        if name in results.get("cases", {}):
            epoch = statistics.median(results["cases"][name]["h"])
            break
    cost = w["copy_s"] + w["lost_thread_s"]

    def share(seconds: float) -> str:
        return f"{100 * seconds / epoch:.2f}" if epoch else "-"

    header = ["what", "ms per epoch end", "% of a hand-written resnet18 epoch"]
    rows = [["snapshot of weights + optimizer state (training waits)", f"{w['copy_s'] * 1e3:.1f}", share(w["copy_s"])],
            ["writing them in the background thread (its own time)", f"{w['write_s'] * 1e3:.0f}", "-"],
            [f"training slowed meanwhile, writer thread ({w['steps']} steps of "
             f"{w['alone_s'] * 1e3 / w['steps']:.0f} ms)", f"{w['lost_thread_s'] * 1e3:+.1f}", share(w["lost_thread_s"])],
            ["training slowed meanwhile, writer in another process", f"{w['lost_process_s'] * 1e3:+.1f}",
             share(w["lost_process_s"])],
            ["snapshot + writer thread", f"{cost * 1e3:.1f}", share(cost)]]
    return _table(header, rows, markdown)


SEEDING_FLOOR = 0.95   # loader throughput with per-sample seeding, relative to without
SEEDING_ITEM_US, SEEDING_BATCH_US = 1.5, 10.0   # its CPU cost with 0 workers (issue 26)


def targets(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every target with its measured figure and whether it is met."""
    out = []
    cases = results.get("cases", {})
    for name, case in cases.items():
        r = case_row(name, case)
        out.append({"target": f"{name}: CPU-time ratio (median) <= {r['target']:.2f}",
                    "measured": f"{r['cpu_ratio']:.3f} [{r['cpu_ratio_lo']:.3f}, {r['cpu_ratio_hi']:.3f}]",
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
    data = results.get("data") or {}
    if "2" in data and "2-unseeded" in data:
        ratio = data["2"]["second"] / data["2-unseeded"]["second"]
        out.append({"target": f"loader with 2 workers, per-sample seeding >= {SEEDING_FLOOR:.2f}x without",
                    "measured": f"{ratio:.3f}x", "meets": ratio >= SEEDING_FLOOR})
    for name, v in (results.get("seeding") or {}).items():
        if "no random draws" in name:
            out.append({"target": f"per-sample seeding, {name}: <= {SEEDING_ITEM_US:g} us per item and "
                                  f"<= {SEEDING_BATCH_US:g} us per batch",
                        "measured": f"{v['per_item_us']:.2f} us, {v['per_batch_us']:.1f} us",
                        "meets": v["per_item_us"] <= SEEDING_ITEM_US and v["per_batch_us"] <= SEEDING_BATCH_US})
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
    for title, table in (("Loop: basetrainer (B) vs hand-written PyTorch (H), CPU time", loop_table(results)),
                         ("The same in wall time", wall_table(results)),
                         ("Targets", targets_table(results)),
                         ("Per-sample seeding (default loader, 0 workers), CPU time", seeding_table(results)),
                         ("Import time beyond torch + torchvision", import_table(results)),
                         ("examples/example.py train loader (digits ImageFolder)", data_table(results)),
                         ("Callback cost (one instrumented run)", costs_table(results)),
                         ("resnet18_on's epoch-end checkpoint", writes_table(results))):
        if table:
            parts.append(f"{title}\n{table}")
    return "\n\n".join(parts)
