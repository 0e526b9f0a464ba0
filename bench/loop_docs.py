"""docs/benchmarks.md and docs/benchmarks.png, written from ``bench_loop.py``'s figures."""
import statistics
from typing import Any, Dict, Optional

from loop_report import (IMPORT_TARGET_S, case_row, costs_table, data_table, findings, import_table, loop_table,
                         targets_table, writes_table)


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

{loop_table(results, markdown=True)}

![ratios](benchmarks.png)

How it is measured:

- The same model (initial weights from one state_dict), the same in-memory `TensorDataset`, the
  same order (`DistributedSampler(num_replicas=world, rank=rank, shuffle=True, seed=2020)` with
  `set_epoch` every epoch, as `build_dataloader` builds it), SGD (lr 0.05, momentum 0.9,
  weight decay 5e-4), cross-entropy, batch size global.
- The two contenders alternate (B, H, H, B, B, H, ...) in one process per round (DDP: inside one
  2-process gloo group started by `basetrainer.engine.launch.launch`, one torch thread per
  process). Each loop case runs several rounds, each in a fresh Python process, the cases taking
  turns (round 1 of every case, then round 2, ...), and the pairs of its rounds are pooled: one
  process, or one stretch of time, can favour a contender for its whole length (where its
  memory landed, a busy spell of the machine), so one process alone is not the case's figure
  (*round medians*: the median of each round's pairs). In each process an untimed
  pair first warms both up and checks equality (with callbacks off, basetrainer gets a
  LossesRecorder for that pair only). Single-process cases use {info['threads']} torch thread(s):
  on a 2-core machine shared with other jobs, two intra-op threads make epoch times swing by
  several times. glibc's malloc moves its mmap and trim thresholds to the largest block freed
  so far, so a run's allocation cost depends on what the process freed before it (8 resnet18
  steps: 0.86 s or 0.68 s, depending only on whether 90 MB had just been freed); unless
  `--malloc default` is given the benchmark fixes both thresholds (the *malloc* row above) for
  itself and the DDP processes, so that each contender starts from the same allocator
  behaviour. *ratio B/H (median)* is the median over all pairs of all rounds
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
  `last.pth`, `model_<epoch>.pth`, `best_model_*.pth`, to a temp folder, written by its
  background thread; waiting for the last epoch's files is part of `on_train_end`, outside the
  epochs, and the hand loop writes no file); the hand loop keeps its
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
