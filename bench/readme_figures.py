"""Re-measure the figures README.md quotes: setup time, the digits example (accuracy, time, disk
use, output), the segmentation and regression examples (per-class IoU; R², MAE and the linear
baseline; times) and the test suite (count, time), with the machine they were measured on.

Usage, from the root of a checkout (best a fresh clone, so setup.sh really installs)::

    python3 bench/readme_figures.py                    # everything, ~10 min on 2 CPU cores
    python3 bench/readme_figures.py --skip-tests       # setup + the examples only
    python3 bench/readme_figures.py --skip-setup --skip-example --skip-tests   # segmentation + regression only
    python3 bench/readme_figures.py --out docs         # also write docs/figures.md

Only the standard library is used here: the script runs ``./setup.sh`` first (timed; a no-op on
a checkout that is already set up) and everything else with ``.venv/bin/python``. It prints one
JSON document; ``--out`` also writes ``figures.md`` there. The benchmark and pruning figures
have their own scripts (``bench/bench_loop.py``, ``bench/prune_latency.py``).
"""
import argparse
import csv
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def machine() -> Dict[str, Any]:
    """CPU model and count, memory, OS, Python/torch versions, GPU, commit, date, load."""
    cpu, mem_gib = "unknown CPU", float("nan")
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
            mem_gib = kib / 2 ** 20
    except (OSError, StopIteration, ValueError):
        pass
    probe = subprocess.run([PY, "-c", "import json, platform, torch, torchvision; print(json.dumps({"
                            "'python': platform.python_version(), 'torch': torch.__version__, "
                            "'torchvision': torchvision.__version__, 'cuda': torch.cuda.is_available(), "
                            "'threads': torch.get_num_threads()}))"],
                           capture_output=True, text=True, timeout=120, check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1),
            "os": f"{platform.system()} {platform.release()}", **json.loads(probe.stdout),
            "commit": commit, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "load_start": load()}


def load() -> float:
    """The 1-minute load average: on a shared machine it says how far a time can be trusted."""
    return round(os.getloadavg()[0], 2)


def timed(cmd: List[str], **kwargs: Any) -> Dict[str, Any]:
    before, start = load(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, **kwargs)
    return {"seconds": time.perf_counter() - start, "code": proc.returncode, "stdout": proc.stdout,
            "stderr": proc.stderr, "load": [before, load()]}


def disk_use(folder: str) -> Dict[str, Any]:
    """Bytes under ``folder`` (a hard-linked file counted once, as ``du`` does) and per file."""
    seen, total, files = set(), 0, {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            st = os.lstat(path)
            files[os.path.relpath(path, folder)] = st.st_size
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return {"bytes": total, "files": dict(sorted(files.items()))}


def run_example(work_dir: str, extra: List[str]) -> Dict[str, Any]:
    """examples/example.py with its defaults (stdout and stderr are pipes, as in CI or nohup)."""
    prep = timed([PY, "-c", "import sys; sys.path.insert(0, 'examples'); "
                  "from prepare_data import DEFAULT_ROOT, prepare_digits; prepare_digits(DEFAULT_ROOT)"])
    if prep["code"]:
        raise SystemExit(f"preparing the digits failed:\n{prep['stderr'].decode(errors='replace')}")
    run = timed([PY, "examples/example.py", "--work_dir", work_dir, *extra])
    out, err = run["stdout"].decode(errors="replace"), run["stderr"].decode(errors="replace")
    if run["code"]:
        raise SystemExit(f"the example failed ({run['code']}):\n{out[-3000:]}\n{err[-3000:]}")
    final = re.search(r"final test/Accuracy: (\d\.\d+) \(best (\d\.\d+)\) after (\d+) epochs", out)
    with open(os.path.join(work_dir, "log", "history.csv"), newline="") as f:
        epoch_times = [float(row["epoch_time"]) for row in csv.DictReader(f)]
    return {"command": "python examples/example.py " + " ".join(extra), "seconds": round(run["seconds"], 1),
            "prepare_data_seconds": round(prep["seconds"], 1),
            "final_accuracy": float(final.group(1)), "best_accuracy": float(final.group(2)),
            "epochs": int(final.group(3)), "epoch_seconds": [round(t, 2) for t in epoch_times],
            "load": run["load"],
            "disk": disk_use(work_dir),
            "carriage_returns": {"stdout": out.count("\r"), "stderr": err.count("\r")},
            "longest_line": max((len(line) for line in (out + "\n" + err).split("\n")), default=0)}


def run_task_examples(work_root: str) -> Dict[str, Any]:
    """examples/segmentation.py and examples/regression.py with their defaults (full runs), timed."""
    out: Dict[str, Any] = {}
    seg = timed([PY, "examples/segmentation.py", "--no-progress", "--work_dir", os.path.join(work_root, "shapes")])
    text = seg["stdout"].decode(errors="replace")
    if seg["code"]:
        raise SystemExit(f"the segmentation example failed ({seg['code']}):\n{text[-3000:]}\n"
                         f"{seg['stderr'].decode(errors='replace')[-3000:]}")
    final = re.search(r"final test/IoU: background (\S+), circle (\S+), square (\S+), triangle (\S+); min over "
                      r"shapes (\S+); mean IoU (\S+) \(best (\S+)\) after (\d+) epochs in (\S+) s", text)
    with open(os.path.join(work_root, "shapes", "log", "history.csv"), newline="") as f:
        epoch_times = [float(row["epoch_time"]) for row in csv.DictReader(f)]
    out["segmentation"] = {"command": "python examples/segmentation.py", "seconds": round(seg["seconds"], 1),
                           "iou": dict(zip(["background", "circle", "square", "triangle"],
                                           map(float, final.group(1, 2, 3, 4)))),
                           "min_shape_iou": float(final.group(5)), "mean_iou": float(final.group(6)),
                           "best_mean_iou": float(final.group(7)), "epochs": int(final.group(8)),
                           "train_seconds": float(final.group(9)),
                           "epoch_seconds": [round(t, 1) for t in epoch_times], "load": seg["load"]}
    reg = timed([PY, "examples/regression.py", "--work_dir", os.path.join(work_root, "diabetes")])
    text = reg["stdout"].decode(errors="replace")
    if reg["code"]:
        raise SystemExit(f"the regression example failed ({reg['code']}):\n{text[-3000:]}\n"
                         f"{reg['stderr'].decode(errors='replace')[-3000:]}")
    final = re.search(r"final test/R2: (\S+) test/MAE: (\S+) \(lowest MAE (\S+) at epoch (\d+), R2 (\S+)\); linear "
                      r"regression baseline R2: (\S+) MAE: (\S+); (\d+) epochs in (\S+) s", text)
    out["regression"] = {"command": "python examples/regression.py", "seconds": round(reg["seconds"], 1),
                         "r2": float(final.group(1)), "mae": float(final.group(2)),
                         "lowest_mae": float(final.group(3)), "lowest_mae_epoch": int(final.group(4)),
                         "r2_at_lowest_mae": float(final.group(5)), "linear_r2": float(final.group(6)),
                         "linear_mae": float(final.group(7)), "epochs": int(final.group(8)),
                         "train_seconds": float(final.group(9)), "load": reg["load"]}
    return out


def run_tests() -> Dict[str, Any]:
    """The suite as README runs it; the counts from pytest's closing line."""
    run = timed([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"])
    tail = run["stdout"].decode(errors="replace").strip().splitlines()[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", tail)}
    return {"code": run["code"], "seconds": round(run["seconds"], 1), "summary": tail, "counts": counts,
            "load": run["load"]}


def markdown(results: Dict[str, Any]) -> str:
    m = results["machine"]
    lines = ["# README figures", "",
             f"Measured by `python3 bench/readme_figures.py` on {m['date']} at commit {m['commit']}: "
             f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}, "
             f"{'a CUDA GPU' if m['cuda'] else 'no GPU'}; Python {m['python']}, torch {m['torch']}, "
             f"torchvision {m['torchvision']}; load average {m['load_start']} at the start (a "
             f"time measured while other work shares the cores is longer).", "",
             "| figure | value |", "|---|---|"]
    if "setup" in results:
        s = results["setup"]
        lines.append(f"| `./setup.sh` | {s['seconds']:.0f} s ({'fresh install' if s['installed'] else 'already set up'}) |")
    if "example" in results:
        e = results["example"]
        mib = e["disk"]["bytes"] / 2 ** 20
        lines += [f"| `{e['command'].strip()}` | final test/Accuracy {e['final_accuracy']:.4f} (best "
                  f"{e['best_accuracy']:.4f}) after {e['epochs']} epochs |",
                  f"| its time, the whole command | {e['seconds']:.0f} s (digits prepared beforehand in "
                  f"{e['prepare_data_seconds']:.0f} s; load average {e['load'][0]} before, {e['load'][1]} after) |",
                  f"| its epochs | {', '.join(f'{t:.1f}' for t in e['epoch_seconds'])} s |",
                  f"| its work_dir on disk | {e['disk']['bytes']:,} bytes ({mib:.0f} MiB) |",
                  f"| carriage returns in its stdout / stderr (not terminals) | {e['carriage_returns']['stdout']} / "
                  f"{e['carriage_returns']['stderr']}; longest line {e['longest_line']} characters |"]
        lines += [f"| &nbsp;&nbsp;`{name}` | {size:,} bytes |" for name, size in e["disk"]["files"].items()]
    if "segmentation" in results:
        g = results["segmentation"]
        lines += [f"| `{g['command']}` | test IoU " + ", ".join(f"{k} {v:.4f}" for k, v in g["iou"].items())
                  + f" (mean {g['mean_iou']:.4f}) after {g['epochs']} epochs |",
                  f"| its time, the whole command | {g['seconds']:.0f} s (epochs "
                  f"{', '.join(f'{t:.0f}' for t in g['epoch_seconds'])} s; load average {g['load'][0]} before, "
                  f"{g['load'][1]} after) |"]
    if "regression" in results:
        r = results["regression"]
        lines += [f"| `{r['command']}` | test R² {r['r2']:.4f}, MAE {r['mae']:.2f} after {r['epochs']} epochs "
                  f"(linear regression: R² {r['linear_r2']:.4f}, MAE {r['linear_mae']:.2f}) |",
                  f"| its time, the whole command | {r['seconds']:.0f} s (load average {r['load'][0]} before, "
                  f"{r['load'][1]} after) |"]
    if "tests" in results:
        t = results["tests"]
        lines.append(f"| `.venv/bin/python -m pytest` | {t['summary']} (wall {t['seconds']:.0f} s, exit {t['code']}; "
                     f"load average {t['load'][0]} before, {t['load'][1]} after) |")
    return "\n".join(lines) + "\n"


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-setup", action="store_true", help="do not run ./setup.sh (.venv must exist)")
    parser.add_argument("--skip-example", action="store_true")
    parser.add_argument("--skip-tasks", action="store_true", help="do not run the segmentation and regression examples")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--out", default="", help="folder for figures.md (e.g. docs)")
    args = parser.parse_args(argv)

    results: Dict[str, Any] = {}
    if not args.skip_setup:
        fresh = not os.path.exists(os.path.join(ROOT, ".venv", ".setup-stamp"))
        say("setup.sh ...")
        setup = timed(["./setup.sh"])
        if setup["code"]:
            raise SystemExit(f"setup.sh failed:\n{setup['stderr'].decode(errors='replace')}")
        results["setup"] = {"seconds": round(setup["seconds"], 1), "installed": fresh}
    results["machine"] = machine()
    say(f"machine: {results['machine']}")
    if not args.skip_example:
        say("the example (about 2 minutes) ...")
        with tempfile.TemporaryDirectory(prefix="readme_figures_") as tmp:
            results["example"] = run_example(os.path.join(tmp, "digits"), [])
        say(f"example: {results['example']['final_accuracy']} in {results['example']['seconds']} s")
    if not args.skip_tasks:
        say("the segmentation and regression examples (about 3 minutes) ...")
        with tempfile.TemporaryDirectory(prefix="readme_figures_") as tmp:
            results.update(run_task_examples(tmp))
        say(f"segmentation: {results['segmentation']['iou']} in {results['segmentation']['seconds']} s; "
            f"regression: R2 {results['regression']['r2']} (linear {results['regression']['linear_r2']}) "
            f"in {results['regression']['seconds']} s")
    if not args.skip_tests:
        say("the test suite (about 4 minutes) ...")
        results["tests"] = run_tests()
        say(f"tests: {results['tests']['summary']}")
    results["load_end"] = load()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "figures.md"), "w", encoding="utf-8") as f:
            f.write(markdown(results))
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
