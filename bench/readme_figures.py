"""Re-measure the figures README.md quotes: setup time, the digits example (accuracy, time, disk
use, output), the segmentation and regression examples (per-class IoU; R², MAE and the linear
baseline; times) and the test suite (count, time), with the machine they were measured on.

Usage, from the root of a checkout (best a fresh clone, so setup.sh really installs)::

    python3 bench/readme_figures.py                    # everything, ~10 min on 2 CPU cores
    python3 bench/readme_figures.py --skip-tests       # setup + the examples only
    python3 bench/readme_figures.py --skip-setup --skip-example --skip-tests   # segmentation + regression only
    python3 bench/readme_figures.py --out docs         # also write docs/figures.md and the quotes
    python3 bench/readme_figures.py --quote            # only rewrite the quotes from docs/figures.md

Only the standard library is used here: the script runs ``./setup.sh`` first (timed; a no-op on
a checkout that is already set up) and everything else with ``.venv/bin/python``. It prints one
JSON document; ``--out`` also writes ``figures.md`` there. docs/figures.md is the one source of
the Quickstart's figure: README.md and docs/index.md quote it between ``<!-- quickstart-figure:
... -->`` and ``<!-- /quickstart-figure -->``, rewritten from docs/figures.md by ``--out docs``
and ``--quote`` (tests/test_readme.py checks that they agree). The benchmark and pruning figures
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


# ---------------------------------------------------------------------------------- the quotes
FIGURES_MD = os.path.join(ROOT, "docs", "figures.md")
QUOTE = re.compile(r"(<!-- quickstart-figure: [^\n]*-->\n)(.*?)(<!-- /quickstart-figure -->)", re.S)
QUOTED_IN = {"readme": os.path.join(ROOT, "README.md"), "index": os.path.join(ROOT, "docs", "index.md")}
VAL_IMAGES = 360         # examples/prepare_data.py's validation split of the 1,797 digits
DEFAULT_WORK_DIR = "work_space/digits"   # configs/config.yaml's (the script runs the example elsewhere)


def parse_figures_md(text: str) -> Dict[str, Any]:
    """The machine and the example's figures from a figures.md that :func:`markdown` wrote."""
    head = re.search(r"on (?P<date>\S+ \S+) at commit (?P<commit>\w+): (?P<cpu>.+?), (?P<cores>\d+) cores, "
                     r"(?P<memory>\S+) GiB, (?P<os>.+?), (?P<gpu>a CUDA GPU|no GPU); Python (?P<python>\S+), "
                     r"torch (?P<torch>\S+), torchvision (?P<torchvision>\S+);", text)
    if head is None:
        raise ValueError("docs/figures.md has no 'Measured by ... on <date> at commit <commit>: ...' line: "
                         "rewrite it with python3 bench/readme_figures.py --out docs")
    rows = [line.split(" | ", 1)[1].rstrip(" |") for line in text.splitlines()
            if line.startswith("| ") and " | " in line[2:]]
    start = next((i for i, row in enumerate(rows) if row.startswith("final test/Accuracy")), None)
    if start is None:
        raise ValueError("docs/figures.md holds no example figures (it was written with --skip-example): "
                         "rewrite it with python3 bench/readme_figures.py --out docs")
    final = re.match(r"final test/Accuracy (\S+) \(best (\S+)\) after (\d+) epochs", rows[start])
    took = re.match(r"(\d+) s \(digits prepared beforehand in (\d+) s", rows[start + 1])
    epochs = [float(t) for t in rows[start + 2].rstrip(" s").split(", ")]
    disk = re.match(r"([\d,]+) bytes", rows[start + 3])
    return {**head.groupdict(), "cores": int(head.group("cores")), "final_accuracy": float(final.group(1)),
            "best_accuracy": float(final.group(2)), "epochs": int(final.group(3)), "seconds": int(took.group(1)),
            "prepare_seconds": int(took.group(2)), "epoch_seconds": epochs,
            "disk_bytes": int(disk.group(1).replace(",", ""))}


def quote(m: Dict[str, Any], page: str) -> str:
    """What README.md (``page="readme"``) or the docs' front page (``"index"``) says of the
    Quickstart's first command: its last line of output and when, where and how fast it was measured."""
    line = (f"    final test/Accuracy: {m['final_accuracy']:.4f} (best {m['best_accuracy']:.4f}) after "
            f"{m['epochs']} epochs; work_dir: {DEFAULT_WORK_DIR}")
    machine = f"{m['cpu']}, {m['cores']} cores, {'a CUDA GPU' if m['gpu'] == 'a CUDA GPU' else 'no GPU'}"
    wrong = round((1 - m["final_accuracy"]) * VAL_IMAGES)
    spread = (f"Another CPU or torch build can differ by a few test images (1/{VAL_IMAGES} = "
              f"{1 / VAL_IMAGES:.4f} each); the spread over seeds and machines is not measured yet.")
    if page == "readme":
        text = (f"Measured by `bench/readme_figures.py` on {m['date']} at commit {m['commit']} ({machine}; "
                f"torch {m['torch']}): {m['seconds']} s for the command, the digits already written "
                f"([all figures](docs/figures.md)). {spread}")
    else:
        text = (f"Measured by `bench/readme_figures.py` on {m['date']} at commit {m['commit']} ({machine}, "
                f"{m['memory']} GiB; Python {m['python']}, torch {m['torch']}): **{100 * m['final_accuracy']:.1f}% "
                f"validation accuracy ({m['final_accuracy']:.4f}: {wrong} of the {VAL_IMAGES} images wrong) in "
                f"{m['seconds']} s** for the whole command with the digits already written, {m['epochs']} epochs "
                f"of {min(m['epoch_seconds']):.1f}–{max(m['epoch_seconds']):.1f} s, "
                f"{m['disk_bytes'] / 1e6:.0f} MB written ([measured figures](figures.md)). The data order, "
                f"augmentation and initialisation are seeded per sample, so a rerun on that machine gives the "
                f"same figure. {spread}")
    return f"\n{line}\n\n{wrap(text)}\n"


def wrap(text: str, width: int = 100) -> str:
    lines, current = [], ""
    for word in text.split(" "):
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return "\n".join(lines + [current])


def write_quotes() -> List[str]:
    """Rewrite the quickstart-figure sections of README.md and docs/index.md from docs/figures.md."""
    with open(FIGURES_MD, encoding="utf-8") as f:
        measured = parse_figures_md(f.read())
    pages = {}
    for page, path in QUOTED_IN.items():          # every page checked before any is written
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not QUOTE.search(text):
            raise SystemExit(f"{path} has no '<!-- quickstart-figure: ... -->' ... '<!-- /quickstart-figure -->' "
                             f"section for the figure")
        new = QUOTE.sub(lambda match: match.group(1) + quote(measured, page) + match.group(3), text, count=1)
        if new != text:
            pages[path] = new
    for path, new in pages.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return [os.path.relpath(path, ROOT) for path in pages]


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-setup", action="store_true", help="do not run ./setup.sh (.venv must exist)")
    parser.add_argument("--skip-example", action="store_true")
    parser.add_argument("--skip-tasks", action="store_true", help="do not run the segmentation and regression examples")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--out", default="", help="folder for figures.md (e.g. docs; docs also rewrites the quotes)")
    parser.add_argument("--quote", action="store_true",
                        help="measure nothing: rewrite the quotes in README.md and docs/index.md from docs/figures.md")
    args = parser.parse_args(argv)
    if args.quote:
        for path in write_quotes():
            say(f"quoted docs/figures.md in {path}")
        return {}

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
        if os.path.abspath(args.out) == os.path.join(ROOT, "docs") and "example" in results:
            for path in write_quotes():
                say(f"quoted docs/figures.md in {path}")
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
