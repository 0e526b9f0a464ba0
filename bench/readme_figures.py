"""Re-measure the figures README.md quotes: setup time, the digits example (accuracy, time, disk
use, output; its accuracy over seeds), the imbalanced digits (recall per class over seeds), the
segmentation and regression examples (per-class IoU; R², MAE and the linear baseline; times) and
the test suite (count, time), with the machine they were measured on.

Usage, from the root of a checkout (best a fresh clone, so setup.sh really installs)::

    python3 bench/readme_figures.py                    # everything, ~10 min on 2 CPU cores
    python3 bench/readme_figures.py --skip-tests       # setup + the examples only
    python3 bench/readme_figures.py --skip-setup --skip-example --skip-tests   # segmentation + regression only
    python3 bench/readme_figures.py --out docs         # also write docs/figures.md and the quotes
    python3 bench/readme_figures.py --quote            # only rewrite the quotes from docs/figures.md
    python3 bench/readme_figures.py --skip-setup --skip-tasks --skip-tests --out docs   # README's two

The Quickstart's command runs once per seed of ``--seeds`` (default 2020 1 2; 2020, its default,
first: README quotes that run's line), each in its own work_dir, and examples/imbalanced.py once
per seed; README states the spread over the seeds (the Quickstart's min–max and mean; the imbalanced
table's mean per cell with its min–max). One machine's seeds, not other machines: the CPU is named
(model, cores, AVX-512) with torch's build and the CPU kernels it picked, since another CPU picks
other kernels and moves the last digits.

Only the standard library is used here: the script runs ``./setup.sh`` first (timed; a no-op on
a checkout that is already set up) and everything else with ``.venv/bin/python``. It prints one
JSON document; ``--out`` also writes ``figures.md`` there. docs/figures.md is the one source of
the Quickstart's figure: README.md and docs/index.md quote it between ``<!-- quickstart-figure:
... -->`` and ``<!-- /quickstart-figure -->``, rewritten from docs/figures.md by ``--out docs``
and ``--quote``, and README's imbalanced table between ``<!-- imbalanced-table: ... -->`` and
``<!-- /imbalanced-table -->`` (tests/test_readme.py checks that they agree). A run that skips a
part keeps that part's rows from the figures.md it replaces, under their own date. The benchmark and pruning figures
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
# the checkout's own environment (./setup.sh makes it); without one, the Python running this script
PY = os.path.join(ROOT, ".venv", "bin", "python")
PY = PY if os.path.exists(PY) else sys.executable
# the seeds the Quickstart (its default, 2020, first) and the imbalanced comparison are run with
SEEDS = [2020, 1, 2]
DEFAULT_SEED = 2020      # examples/example.py's: the Quickstart's command passes no --seed


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def machine() -> Dict[str, Any]:
    """CPU model and count, memory, OS, Python/torch versions, GPU, commit, date, load."""
    cpu, mem_gib, avx512 = "unknown CPU", float("nan"), False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
        flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
        avx512 = "avx512f" in flags         # the kernels torch picks (and so the last digits) follow it
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
            mem_gib = kib / 2 ** 20
    except (OSError, StopIteration, ValueError):
        pass
    probe = subprocess.run([PY, "-c", "import json, platform, torch, torch.backends.cpu, torchvision; print(json.dumps({"
                            "'python': platform.python_version(), 'torch': torch.__version__, "
                            "'torchvision': torchvision.__version__, 'cuda': torch.cuda.is_available(), "
                            "'threads': torch.get_num_threads(), 'capability': getattr(torch.backends.cpu, "
                            "'get_cpu_capability', lambda: 'unknown')()}))"],
                           capture_output=True, text=True, timeout=120, check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "avx512": avx512, "memory_gib": round(mem_gib, 1),
            "os": f"{platform.system()} {platform.release()}", **json.loads(probe.stdout),
            "commit": commit, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "load_start": load()}


def load() -> float:
    """The 1-minute load average: on a shared machine it says how far a time can be trusted."""
    return round(os.getloadavg()[0], 2)


def timed(cmd: List[str], **kwargs: Any) -> Dict[str, Any]:
    before, start = load(), time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    # idle OpenMP threads sleep instead of spinning: on cores other jobs share, a spinning thread
    # takes the time its partner needs (epochs of the example took 160-300 s instead of 7 s); the
    # threads and their split of the work, and so the figures, are the same
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, env=env, **kwargs)   # this checkout's package
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


def seed_flags(seed: int) -> List[str]:
    """The flags that run ``seed``: none for the examples' default (the command as README prints it)."""
    return [] if seed == DEFAULT_SEED else ["--seed", str(seed)]


def run_example_seeds(seeds: List[int]) -> Dict[str, Any]:
    """The Quickstart's command once per seed, each in its own work_dir: the default seed's run in
    full (``example``) and each seed's final accuracy (``example_seeds``), in the order given."""
    out: Dict[str, Any] = {"example_seeds": []}
    for seed in seeds:
        say(f"the example, seed {seed} (about 2 minutes) ...")
        with tempfile.TemporaryDirectory(prefix="readme_figures_") as tmp:
            run = run_example(os.path.join(tmp, "digits"), seed_flags(seed))
        if seed == DEFAULT_SEED:
            out["example"] = run
        out["example_seeds"].append({"seed": seed, "final_accuracy": run["final_accuracy"],
                                     "best_accuracy": run["best_accuracy"], "epochs": run["epochs"],
                                     "seconds": run["seconds"], "load": run["load"]})
        say(f"example, seed {seed}: {run['final_accuracy']} in {run['seconds']} s")
    return out


def run_imbalanced(seeds: List[int]) -> Dict[str, Any]:
    """examples/imbalanced.py with its defaults (balance none and sqrt) once per seed: per seed and
    balance the recall per class, accuracy and balanced accuracy its EvalReport wrote."""
    runs, settings = [], {}
    for seed in seeds:
        say(f"examples/imbalanced.py, seed {seed} (two trainings, about 3 minutes) ...")
        with tempfile.TemporaryDirectory(prefix="readme_figures_") as tmp:
            run = timed([PY, "examples/imbalanced.py", "--work_dir", tmp, *seed_flags(seed)])
            if run["code"]:
                raise SystemExit(f"examples/imbalanced.py failed ({run['code']}):\n"
                                 f"{run['stdout'].decode(errors='replace')[-3000:]}\n"
                                 f"{run['stderr'].decode(errors='replace')[-3000:]}")
            with open(os.path.join(tmp, "imbalanced", "imbalanced.json"), encoding="utf-8") as f:
                result = json.load(f)
            first = os.path.join(tmp, "imbalanced", f"balance_{next(iter(result))}", "config.yaml")
            with open(first, encoding="utf-8") as f:      # the settings the runs were trained with
                config = f.read()
        settings = {"num_epochs": int(re.search(r"^num_epochs: (\d+)", config, re.M).group(1)),
                    "input_size": [int(v) for v in re.findall(r"\d+", re.search(
                        r"^input_size:((?: \[.*?\])|(?:\n- \d+)+)", config, re.M).group(1))],
                    "net_type": re.search(r"^net_type: (\S+)", config, re.M).group(1)}
        for balance, r in result.items():
            runs.append({"seed": seed, "balance": balance, "recall": r["recall"], "accuracy": r["accuracy"],
                         "balanced_accuracy": r["balanced_accuracy"]})
        say(f"imbalanced, seed {seed}: " + ", ".join(f"{b} {r['balanced_accuracy']:.4f}" for b, r in result.items())
            + f" in {run['seconds']:.0f} s")
    return {"imbalanced": {"command": "python examples/imbalanced.py", **settings, "runs": runs}}


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
             f"{m['cpu']}, {m['cores']} cores, {'AVX-512' if m['avx512'] else 'no AVX-512'}, "
             f"{m['memory_gib']} GiB, {m['os']}, {'a CUDA GPU' if m['cuda'] else 'no GPU'}; Python "
             f"{m['python']}, torch {m['torch']} (CPU kernels {m['capability']}, {m['threads']} threads), "
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
    if "example_seeds" in results:
        runs = results["example_seeds"]
        lines += ["", "## The Quickstart over seeds", "",
                  f"`python examples/example.py` (seed {DEFAULT_SEED}, its default) and with `--seed` for the "
                  f"others, each in its own work_dir, one after the other on this machine:", "",
                  "| seed | final test/Accuracy | best | epochs | time |", "|---|---|---|---|---|"]
        lines += [f"| {r['seed']} | {r['final_accuracy']:.4f} | {r['best_accuracy']:.4f} | {r['epochs']} | "
                  f"{r['seconds']:.0f} s |" for r in runs]
        lines += ["", spread_sentence(parse_seeds("\n".join(lines))) + "."]
    if "imbalanced" in results:
        im = results["imbalanced"]
        classes = list(im["runs"][0]["recall"])
        lines += ["", "## The imbalanced digits over seeds", "",
                  f"`{im['command']}` with its defaults ({im['net_type']}, {'×'.join(map(str, im['input_size']))}, "
                  f"{im['num_epochs']} epochs; classes 0–2 cut to 10 % of their training images), balance none "
                  f"and sqrt, once per seed; recall per class on the 360 validation images:", "",
                  "| seed | balance | " + " | ".join(f"recall {c}" for c in classes) + " | accuracy | balanced accuracy |",
                  "|---" * (len(classes) + 4) + "|"]
        lines += [f"| {r['seed']} | {r['balance']} | " + " | ".join(f"{r['recall'][c]:.4f}" for c in classes)
                  + f" | {r['accuracy']:.4f} | {r['balanced_accuracy']:.4f} |" for r in im["runs"]]
        lines += ["", "The mean over the seeds, (min–max) where they differ, as README quotes it:", ""]
        lines += [imbalanced_table(parse_imbalanced("\n".join(lines)))]
    return "\n".join(lines) + "\n"


def carried(old: str, results: Dict[str, Any]) -> str:
    """The rows of an earlier figures.md (``old``) for what this run did not measure (``--skip-...``),
    under their own 'Measured by' line: a section not rerun keeps its figures and says when they are from."""
    group_of = {"`./setup.sh`": "setup", "`python examples/example.py`": "example",
                "`python examples/segmentation.py`": "segmentation", "`python examples/regression.py`": "regression",
                "`.venv/bin/python -m pytest`": "tests"}
    kept: Dict[str, List[str]] = {}
    header, group = "", ""
    for line in old.splitlines():
        if line.startswith("Measured by"):
            header, group = line, ""
        elif line.startswith("## ") and not line.startswith("## Not rerun"):
            header, group = "", ""                              # a section of seeds: rerun with the example
        elif line.startswith("| ") and header:
            first = line.split(" | ", 1)[0][2:]
            group = group_of.get(first, group if first.startswith(("its ", "&nbsp;")) else "")
            if group and group not in results:
                kept.setdefault(header, []).append(line)
    if not kept:
        return ""
    out = ["", f"## Not rerun on {results['machine']['date']}", ""]
    for header, rows in kept.items():
        out += [header, "", "| figure | value |", "|---|---|", *rows, ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------- the quotes
FIGURES_MD = os.path.join(ROOT, "docs", "figures.md")
QUOTE = re.compile(r"(<!-- quickstart-figure: [^\n]*-->\n)(.*?)(<!-- /quickstart-figure -->)", re.S)
TABLE = re.compile(r"(<!-- imbalanced-table: [^\n]*-->\n)(.*?)(<!-- /imbalanced-table -->)", re.S)
QUOTED_IN = {"readme": os.path.join(ROOT, "README.md"), "index": os.path.join(ROOT, "docs", "index.md")}
VAL_IMAGES = 360         # examples/prepare_data.py's validation split of the 1,797 digits
DEFAULT_WORK_DIR = "work_space/digits"   # configs/config.yaml's (the script runs the example elsewhere)


def parse_figures_md(text: str) -> Dict[str, Any]:
    """The machine and the example's figures from a figures.md that :func:`markdown` wrote."""
    text = this_run(text)
    head = re.search(r"on (?P<date>\S+ \S+) at commit (?P<commit>\w+): (?P<cpu>.+?), (?P<cores>\d+) cores, "
                     r"(?:(?P<avx512>(?:no )?AVX-512), )?(?P<memory>\S+) GiB, (?P<os>.+?), (?P<gpu>a CUDA GPU|no GPU); "
                     r"Python (?P<python>\S+), torch (?P<torch>\S+?)(?: \(CPU kernels (?P<capability>\w+), "
                     r"(?P<threads>\d+) threads\))?, torchvision (?P<torchvision>\S+);", text)
    if head is None:
        raise ValueError("docs/figures.md has no 'Measured by ... on <date> at commit <commit>: ...' line: "
                         "rewrite it with python3 bench/readme_figures.py --out docs")
    rows = [line.split(" | ", 1)[1].rstrip(" |") for line in text.split("\n## ")[0].splitlines()
            if line.startswith("| ") and " | " in line[2:]]
    start = next((i for i, row in enumerate(rows) if row.startswith("final test/Accuracy")), None)
    if start is None:
        raise ValueError("docs/figures.md holds no example figures (it was written with --skip-example): "
                         "rewrite it with python3 bench/readme_figures.py --out docs")
    final = re.match(r"final test/Accuracy (\S+) \(best (\S+)\) after (\d+) epochs", rows[start])
    took = re.match(r"(\d+) s \(digits prepared beforehand in (\d+) s(?:; load average (\S+) before)?", rows[start + 1])
    epochs = [float(t) for t in rows[start + 2].rstrip(" s").split(", ")]
    disk = re.match(r"([\d,]+) bytes", rows[start + 3])
    return {**head.groupdict(), "cores": int(head.group("cores")), "final_accuracy": float(final.group(1)),
            "best_accuracy": float(final.group(2)), "epochs": int(final.group(3)), "seconds": int(took.group(1)),
            "prepare_seconds": int(took.group(2)), "load": took.group(3), "epoch_seconds": epochs,
            "disk_bytes": int(disk.group(1).replace(",", "")), "seeds": parse_seeds(text)}


def this_run(text: str) -> str:
    """figures.md less the rows carried from an earlier run (its 'Not rerun' section)."""
    return text.split("\n## Not rerun")[0]


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", this_run(text), re.S | re.M)
    return match.group(1) if match else ""


def parse_seeds(text: str) -> List[Dict[str, Any]]:
    """The Quickstart's final accuracy per seed, from figures.md's 'The Quickstart over seeds'."""
    return [{"seed": int(seed), "final_accuracy": float(final), "best_accuracy": float(best)}
            for seed, final, best in re.findall(r"^\| (\d+) \| (\d\.\d{4}) \| (\d\.\d{4}) \| \d+ \|",
                                                section(text, "The Quickstart over seeds"), re.M)]


def spread_sentence(seeds: List[Dict[str, Any]]) -> str:
    finals = [r["final_accuracy"] for r in seeds]
    return (f"Over seeds {', '.join(str(r['seed']) for r in seeds)}: {min(finals):.4f}–{max(finals):.4f}, "
            f"mean {sum(finals) / len(finals):.4f}")


def parse_imbalanced(text: str) -> Dict[str, Any]:
    """examples/imbalanced.py's runs per seed and balance, from figures.md's section of them."""
    part = section(text, "The imbalanced digits over seeds")
    if not part:
        return {}
    table = [line for line in part.splitlines() if line.startswith("| ")]
    head = [cell.strip() for cell in table[0].strip("| ").split(" | ")]
    runs = []
    for line in table[1:]:
        cells = [cell.strip() for cell in line.strip("| ").split(" | ")]
        if not re.fullmatch(r"\d+", cells[0]):
            break                                                   # the rendered table of means
        row = dict(zip(head, cells))
        runs.append({"seed": int(row["seed"]), "balance": row["balance"],
                     "recall": {h.split(" ", 1)[1]: float(row[h]) for h in head if h.startswith("recall ")},
                     "accuracy": float(row["accuracy"]), "balanced_accuracy": float(row["balanced accuracy"])})
    settings = re.search(r"\((?P<net>\w+), (?P<size>\d+×\d+), (?P<epochs>\d+) epochs;", part)
    return {"runs": runs, "net_type": settings.group("net"), "input_size": settings.group("size"),
            "num_epochs": int(settings.group("epochs"))}


def imbalanced_table(im: Dict[str, Any]) -> str:
    """The mean over the seeds per balance and cell, with the range where the seeds differ."""
    def cell(values: List[float], digits: int) -> str:
        mean = f"{sum(values) / len(values):.{digits}f}"
        low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
        return mean if low == high else f"{mean} ({low}–{high})"
    classes = list(im["runs"][0]["recall"])
    balances = list(dict.fromkeys(r["balance"] for r in im["runs"]))
    lines = ["| balance | recall " + " | ".join(classes) + " | accuracy | balanced accuracy |",
             "|---" * (len(classes) + 3) + "|"]
    for balance in balances:
        runs = [r for r in im["runs"] if r["balance"] == balance]
        lines.append(f"| {balance} | " + " | ".join(cell([r["recall"][c] for r in runs], 3) for c in classes)
                     + f" | {cell([r['accuracy'] for r in runs], 4)} | {cell([r['balanced_accuracy'] for r in runs], 4)} |")
    return "\n".join(lines)


def quote(m: Dict[str, Any], page: str) -> str:
    """What README.md (``page="readme"``) or the docs' front page (``"index"``) says of the
    Quickstart's first command: its last line of output and when, where and how fast it was measured."""
    line = (f"    final test/Accuracy: {m['final_accuracy']:.4f} (best {m['best_accuracy']:.4f}) after "
            f"{m['epochs']} epochs; work_dir: {DEFAULT_WORK_DIR}")
    avx = f", {m['avx512']}" if m.get("avx512") else ""
    machine = f"{m['cpu']}, {m['cores']} cores{avx}, {'a CUDA GPU' if m['gpu'] == 'a CUDA GPU' else 'no GPU'}"
    wrong = round((1 - m["final_accuracy"]) * VAL_IMAGES)
    if m.get("seeds"):
        spread = (f"{spread_sentence(m['seeds'])}; on {m['cpu']}. Another CPU or torch build (other kernels) "
                  f"can differ by a few test images more (1/{VAL_IMAGES} = {1 / VAL_IMAGES:.4f} each).")
    else:
        spread = (f"Another CPU or torch build can differ by a few test images (1/{VAL_IMAGES} = "
                  f"{1 / VAL_IMAGES:.4f} each); the spread over seeds and machines is not measured yet.")
    if page == "readme":
        text = (f"Measured by `bench/readme_figures.py` on {m['date']} at commit {m['commit']} ({machine}; "
                f"torch {m['torch']}): {m['seconds']} s for the command at load {m['load']} ([all figures](docs/figures.md)). "
                f"{spread}")
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


def imbalanced_quote(text: str) -> str:
    """What README.md says of examples/imbalanced.py: its settings, seeds, date and machine, and the
    table of the means over the seeds, from docs/figures.md's ``text``."""
    m, im = parse_figures_md(text), parse_imbalanced(text)
    seeds = list(dict.fromkeys(r["seed"] for r in im["runs"]))
    sentence = (f"Its defaults ({im['net_type']}, {im['input_size']}, {im['num_epochs']} epochs), seeds "
                f"{', '.join(map(str, seeds))}; `bench/readme_figures.py` on {m['date']} at {m['commit']} "
                f"({m['cpu']}, {m['cores']} cores, {'a CUDA GPU' if m['gpu'] == 'a CUDA GPU' else 'no GPU'}). "
                f"Recall on the {VAL_IMAGES} validation images, mean over the seeds (min–max):")
    return f"{wrap(sentence, 110)}\n\n{imbalanced_table(im)}\n"


def write_quotes() -> List[str]:
    """Rewrite the quickstart-figure sections of README.md and docs/index.md, and README's
    imbalanced-table section, from docs/figures.md."""
    with open(FIGURES_MD, encoding="utf-8") as f:
        figures = f.read()
    measured = parse_figures_md(figures)
    pages = {}
    for page, path in QUOTED_IN.items():          # every page checked before any is written
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not QUOTE.search(text):
            raise SystemExit(f"{path} has no '<!-- quickstart-figure: ... -->' ... '<!-- /quickstart-figure -->' "
                             f"section for the figure")
        new = QUOTE.sub(lambda match: match.group(1) + quote(measured, page) + match.group(3), text, count=1)
        if page == "readme" and parse_imbalanced(figures):
            if not TABLE.search(new):
                raise SystemExit(f"{path} has no '<!-- imbalanced-table: ... -->' ... '<!-- /imbalanced-table -->' "
                                 f"section for the table")
            new = TABLE.sub(lambda match: match.group(1) + imbalanced_quote(figures) + match.group(3), new, count=1)
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
    parser.add_argument("--skip-imbalanced", action="store_true", help="do not run examples/imbalanced.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=SEEDS,
                        help=f"seeds of the Quickstart and imbalanced runs; the first is the default "
                             f"{DEFAULT_SEED}, the one README's line quotes (default: %(default)s)")
    parser.add_argument("--out", default="", help="folder for figures.md (e.g. docs; docs also rewrites the quotes)")
    parser.add_argument("--quote", action="store_true",
                        help="measure nothing: rewrite the quotes in README.md and docs/index.md from docs/figures.md")
    args = parser.parse_args(argv)
    if args.seeds[0] != DEFAULT_SEED or len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds: distinct seeds, the first {DEFAULT_SEED} (the Quickstart's command as printed)")
    if args.quote:
        for path in write_quotes():
            say(f"quoted docs/figures.md in {path}")
        return {}

    results: Dict[str, Any] = {}
    path = os.path.join(args.out, "figures.md")
    old = open(path, encoding="utf-8").read() if args.out and os.path.exists(path) else ""

    def save() -> None:
        """figures.md with what is measured so far (a run stopped later keeps it)."""
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(markdown(results) + carried(old, results))
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
        results.update(run_example_seeds(args.seeds))
        save()
    if not args.skip_imbalanced:
        results.update(run_imbalanced(args.seeds))
        save()
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
    save()
    if args.out:
        if os.path.abspath(args.out) == os.path.join(ROOT, "docs"):
            for path in write_quotes():
                say(f"quoted docs/figures.md in {path}")
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
