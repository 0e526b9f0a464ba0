"""docs/benchmarks.md and docs/benchmarks.png, written from ``bench_loop.py``'s figures (and the
peers table from ``bench_peers.py``'s docs/peers.json)."""
import json
import os
import statistics
from typing import Any, Dict, Optional

from loop_report import (IMPORT_TARGET_S, case_row, claim, costs_table, data_table, findings, import_table,
                         loop_table, seeding_table, targets_table, wall_table, writes_table)


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
| malloc | {info.get('malloc', "glibc's adaptive thresholds")} |
| torch / torchvision / Python | {info['torch']} / {info['torchvision']} / {info['python']} |
| library state | {info['library']} |
| date | {info['date']} |
| load average (1 min) at start / end | {info['load_start']:.1f} / {results.get('load_end', float('nan')):.1f} |
| run time of this benchmark | {results.get('total_s', 0.0):.0f} s |

## Loop overhead

What a user gets without asking: every case's basetrainer side is an `EngineTrainer` whose train
loader comes from `self.build_dataloader(dataset, batch_size, num_workers, phase="train")` with
nothing else given (per-sample seeding of random draws on, persistent workers when there are
workers); the hand-written loop (H) uses a plain `DataLoader`. The column *basetrainer gets*
names the loader and callbacks of each case.

CPU time (the figures to quote; *overhead* and *ratio* are medians of the paired runs, with a
bootstrap 95% interval):

{loop_table(results, markdown=True)}

Wall time (reported with the spread of its pairs; a busy machine moves it, see below):

{wall_table(results, markdown=True)}

![ratios](benchmarks.png)

How it is measured:

- **CPU time** of a run's epochs is the CPU time of the process over all its threads
  (`time.process_time`: the training thread, intra-op threads, the checkpoint writer and
  TensorBoard threads) plus that of its DataLoader worker processes (live ones read from
  `/proc/<pid>/stat` at 10 ms resolution, ended ones from `getrusage(RUSAGE_CHILDREN)`), summed
  over the ranks in DDP. Other jobs on the machine stretch wall time but not the CPU time the
  run itself uses, so the CPU figures are the steadier ones (shared caches still cost them
  something). Wall time is reported beside them.
- The same model (initial weights from one state_dict), the same data, the same order
  (`DistributedSampler(num_replicas=world, rank=rank, shuffle=True, seed=2020)` with `set_epoch`
  every epoch, as `build_dataloader`'s sampler draws it), SGD (momentum 0.9, weight decay 5e-4),
  cross-entropy (MSE for `regression`), batch size global.
- The two contenders alternate (B, H, H, B, B, H, ...) in one process per round (DDP: inside one
  2-process gloo group started by `basetrainer.engine.launch.launch`, one torch thread per
  process). Each loop case runs several rounds, each in a fresh Python process, the cases taking
  turns (round 1 of every case, then round 2, ...), and the pairs of its rounds are pooled: one
  process, or one stretch of time, can favour a contender for its whole length (where its
  memory landed, a busy spell of the machine), so one process alone is not the case's figure
  (*round medians*: the median CPU ratio of each round's pairs). In each process an untimed
  pair first warms both up and checks equality (with callbacks off, basetrainer gets a
  LossesRecorder for that pair only). Single-process cases use {info['threads']} torch thread(s):
  on a 2-core machine shared with other jobs, two intra-op threads make epoch times swing by
  several times. glibc's malloc moves its mmap and trim thresholds to the largest block freed
  so far, so a run's allocation cost depends on what the process freed before it (8 resnet18
  steps: 0.86 s or 0.68 s, depending only on whether 90 MB had just been freed); unless
  `--malloc default` is given the benchmark fixes both thresholds (the *malloc* row above) for
  itself and the DDP processes.
- *ratio B/H* is the median over all pairs of all rounds of the paired ratio of the run's epoch
  time; *overhead us/step* the median of the paired differences divided by the steps per epoch;
  the intervals are percentiles 2.5 and 97.5 of 4000 bootstrap resamples of the pairs. *ratio
  (best runs)* (wall) is the fastest B run over the fastest H run.
- An epoch runs from just before `set_epoch` to the end of the epoch (basetrainer: after the last
  `on_epoch_end`); a run's epoch time is (last end - first start) / epochs. Trainer
  construction and `on_train_begin`/`on_train_end` (TensorBoard writer, `history.png`, starting
  and ending persistent workers) are outside (median {_outside(results)}).
- Callbacks off: basetrainer has no callback and progress off; the hand loop tracks nothing.
  Callbacks on: AccuracyRecorder, LossesRecorder, the `constant` schedule of
  `build_scheduler.get_scheduler` (per-step LR callback; constant so that training is unchanged),
  LogHistory (log_freq 50, TensorBoard on, lines to a file), ModelCheckpoint (every epoch:
  `last.pth`, `model_<epoch>.pth`, `best_model_*.pth`, to a temp folder, written by its
  background thread; waiting for the last epoch's files is part of `on_train_end`, outside the
  epochs, and the hand loop writes no file); the hand loop keeps its sample-weighted epoch loss
  on the device and reads it once per epoch. Progress bars are off in both settings.
- *max |dloss|*: per-epoch `history["train/loss"]` (LossesRecorder) against the hand loop's
  sample-weighted epoch loss, over every compared run; *max |dweight|*: final weights. Not
  compared on the digits (n/a): their random augmentation draws from per-sample seeds in
  basetrainer and from the generator's stream in the hand loop, by design.
- The gate on the loop's cost is not these times but counts (`tests/test_budget.py`: torch
  ops, host syncs, Python calls inside basetrainer and tensor bytes per step, against a
  hand-written step), which a busy machine cannot move.

Cases:

{spec_lines}

## Targets

{targets_table(results, markdown=True)}

{findings(results)}

{peers_section(os.path.join(os.path.dirname(os.path.abspath(path)), "peers.json"))}

## Import time

{import_table(results, markdown=True)}

*In process*: the import statement timed inside an interpreter that already imported torch and
torchvision. *Fresh process*: wall time of `python -c "import torch, torchvision; <import>"`
minus that of `python -c "import torch, torchvision"` in the same round (start-up noise of
tens of ms on a busy machine).

## Per-sample seeding

{seeding_table(results, markdown=True) or "(not run)"}

CPU time of this thread per batch, `build_dataloader(...)` (per-sample seeding on, the default)
minus the same loader with `seed_per_sample=False`, 0 workers, alternating, each batch size;
the median extra time per batch fitted as *per item* x batch size + *per batch*. A data set pays
for the generators it draws from: one that draws nothing pays for the sample's seed (written as
torch's initial seed) and two reads of where the generators stand per batch; one that draws
from torch also for seeding torch's generator per item (`manual_seed`, about a microsecond on a
quiet machine) and for putting the training's torch state back after each batch.

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

## What resnet18_on's epoch-end checkpoint costs

{writes_table(results, markdown=True) or "(not run)"}

{_writes_method(results.get("writes"))}
"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _writes_method(w: Optional[Dict[str, Any]]) -> str:
    """How the ``writes`` probe measures (with its figures)."""
    if not w:
        return ""
    return (f"The files of one resnet18_on epoch end ({w['mb']:.0f} MB: the epoch's weights and `last.pth` "
            f"with the SGD momentum), written with the library's atomic writer (temp file, fsync, rename) "
            f"from a snapshot of the weights and optimizer state (`atomic.snapshot`, in the training thread). "
            f"Each of {w['repeats']} repeats times {w['steps']} resnet18 training steps (batch 32, one torch "
            f"thread) three ways, the order turning each repeat: alone, while the library's background "
            f"writer thread writes the files, and while a separate process (started once, with its own copy "
            f"of the state) writes them, after one untimed round (a process's first write is slower, once). "
            f"*Training slowed* is the median of the difference to the same repeat's steps alone. The "
            f"other process shares no interpreter lock with the training, so what it costs is the "
            f"machine's own contention (memory bandwidth, page cache).")


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
        lows = [r["cpu_ratio"] - r["cpu_ratio_lo"] for r in rows]
        highs = [r["cpu_ratio_hi"] - r["cpu_ratio"] for r in rows]
        ax.bar(xs, [r["cpu_ratio"] for r in rows], color=colors, alpha=0.8, yerr=[lows, highs], capsize=4)
        for x, r in zip(xs, rows):
            ax.hlines(r["target"], x - 0.42, x + 0.42, colors="black", linestyles="--", linewidth=1.5)
            ax.text(x, r["cpu_ratio_hi"] + 0.004, f"{r['cpu_ratio']:.3f}", ha="center", va="bottom", fontsize=9)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["case"] for r in rows], rotation=25, fontsize=8)
        top = max(max(r["cpu_ratio_hi"] for r in rows), max(r["target"] for r in rows))
        bottom = min(min(r["cpu_ratio_lo"] for r in rows), 1.0)
        ax.set_ylim(bottom - 0.03, top + 0.03)
        ax.set_ylabel("CPU time per epoch, basetrainer / hand-written")
        ax.set_title("Loop overhead in CPU time (median of paired runs; bars: 95% interval; dashed: target)",
                     fontsize=10)
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


def readme_paragraph(results: Dict[str, Any]) -> str:
    """README's benchmark paragraph, from the figures (its claims: overhead per step in CPU time,
    ratio with its interval)."""
    info = results["machine"]
    cases = results.get("cases", {})
    lines = [f"Against a hand-written PyTorch loop doing the same work, on {info['cpu']} ({info['cores']} cores, "
             f"{info['threads']} torch thread per process), {info['date']}, with the loader and callbacks a user "
             f"gets by default (`bench/bench_loop.py`; [benchmarks](docs/benchmarks.md)):", ""]
    for name, case in cases.items():
        r = case_row(name, case)
        lines.append(f"- `{name}` ({r['setup']}): {claim(r)}.")
    seeding = results.get("seeding") or {}
    for name, v in seeding.items():
        lines.append(f"- per-sample seeding, {name}: {v['per_item_us']:.2f} us per item + {v['per_batch_us']:.1f} us "
                     f"per batch (CPU time, 0 workers).")
    lines += ["", "The gate is not a time: `tests/test_budget.py` counts the torch ops, host syncs, Python calls and "
              "tensor bytes of a training step and of the default loader against a hand-written step."]
    return "\n".join(lines)


README_BEGIN, README_END = "<!-- speed: written by bench/bench_loop.py --readme README.md -->", "<!-- /speed -->"


def readme_section(results: Dict[str, Any]) -> str:
    """README's speed section: one row per loop case (its loader and callbacks, overhead per step in
    CPU time and the ratio, each with its bootstrap 95% interval), between the markers."""
    info = results["machine"]
    rows = [case_row(n, c) for n, c in results.get("cases", {}).items()]
    lines = [README_BEGIN,
             f"Against a hand-written PyTorch loop doing the same work ({info['cpu']}, {info['cores']} cores, "
             f"{info['threads']} torch thread, {info['date']}, load {info['load_start']:.1f}; CPU time, median of "
             f"paired runs [95% interval]; [benchmarks](docs/benchmarks.md)):", "",
             "| case | basetrainer gets | overhead us/step | ratio to the hand loop |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['case']}` | {r['setup']} | {r['cpu_overhead_us']:.0f} [{r['cpu_overhead_lo']:.0f}, "
                     f"{r['cpu_overhead_hi']:.0f}] | {r['cpu_ratio']:.3f} [{r['cpu_ratio_lo']:.3f}, "
                     f"{r['cpu_ratio_hi']:.3f}] |")
    seeding = results.get("seeding") or {}
    if seeding:
        name, v = next(iter(seeding.items()))
        lines += ["", f"Per-sample seeding is paid only for the generators a data set draws from; it stays in the "
                      f"loader ({name}: {v['per_item_us']:.2f} us per item + {v['per_batch_us']:.1f} us per batch, "
                      f"CPU time, 0 workers). The test gate counts ops, host syncs and Python calls per step "
                      f"(`tests/test_budget.py`), not times."]
    lines.append(README_END)
    return "\n".join(lines)


def write_readme(path: str, results: Dict[str, Any]) -> None:
    """Replace README's speed section (between the markers) with this run's."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"{path} has no speed section between {README_BEGIN!r} and {README_END!r}")
    text = text[:start] + readme_section(results) + text[end + len(README_END):]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


PEERS_BEGIN, PEERS_END = "<!-- peers: written by bench/bench_peers.py -->", "<!-- /peers -->"


def peers_markdown(summary: Dict[str, Any]) -> str:
    """The peers table of ``bench_peers.py``'s figures, with its date, machine and versions."""
    import bench_peers

    info, versions = summary["machine"], summary.get("versions", {})
    return (f"{PEERS_BEGIN}\n## Peers side by side\n\n"
            f"The same runs trained by each contender with its default settings ({summary['date']}, {info['cpu']}, "
            f"{info['cores']} cores, one torch thread; torch {versions.get('torch', '?')}, Lightning "
            f"{versions.get('lightning', '?')}, Accelerate {versions.get('accelerate', '?')}; "
            f"{summary['rounds']} round(s), `{summary['command']}`):\n\n"
            f"{bench_peers.table(summary['summary'])}\n\n"
            "*CPU ratio to hand*: the contender's CPU time per epoch over the hand-written loop's in the same "
            "round (median over rounds, bootstrap 95% interval). What each contender runs, and its defaults, "
            "is in `bench/bench_peers.py`'s docstring; the peers live in `bench/.venv-peers` "
            f"(`bash bench/peers_env.sh`).\n{PEERS_END}")


def peers_section(peers_json: str) -> str:
    """The peers section from ``peers_json`` (empty markers when it was not run)."""
    if not os.path.isfile(peers_json):
        return f"{PEERS_BEGIN}\n## Peers side by side\n\n(not run: `bash bench/peers_env.sh && .venv/bin/python " \
               f"bench/bench_peers.py --out docs`)\n{PEERS_END}"
    with open(peers_json, encoding="utf-8") as f:
        return peers_markdown(json.load(f))


def replace_peers_section(path: str, summary: Dict[str, Any]) -> None:
    """Rewrite the peers section of docs/benchmarks.md from ``summary`` (appended when absent)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    section = peers_markdown(summary)
    if PEERS_BEGIN in text and PEERS_END in text:
        head, rest = text.split(PEERS_BEGIN, 1)
        text = head + section + rest.split(PEERS_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
