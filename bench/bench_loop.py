"""Benchmark basetrainer's training loop against a hand-written PyTorch loop.

    .venv/bin/python bench/bench_loop.py --out docs --readme README.md   # everything; docs/benchmarks.{md,png}
                                                                         # and README's speed section
    .venv/bin/python bench/bench_loop.py --quick           # a short run of everything
    .venv/bin/python bench/bench_loop.py --cases tiny ddp  # some cases only

Every loop case gives basetrainer the train loader a user gets from
``self.build_dataloader(dataset, batch_size, num_workers, phase="train")`` with nothing else
(per-sample seeding on, persistent workers); the hand loop a plain DataLoader. Cases
(``--cases``; ``tiny`` and ``resnet18`` name both of their settings, ``digits`` both):

- ``tiny_off`` / ``tiny_on``: a tiny CNN on in-memory 3x8x8 tensors, batch 64, where the loop's
  own cost shows (``tiny_off`` is a new user's first trainer); basetrainer without callbacks,
  and with the default set (recorders, LogHistory with TensorBoard, ModelCheckpoint every
  epoch, an LR schedule).
- ``regression``: examples/regression.py's shape: an MLP (10 -> 16 -> 1, tanh) on 353 in-memory
  rows, MSE, batch 32, callbacks off.
- ``resnet18_off`` / ``resnet18_on``: the model zoo's resnet18 at 32x32, a few hundred samples.
- ``digits_w0`` / ``digits_w2``: the digits ImageFolder through examples/example.py's training
  transforms (Resize 32, RandomAffine, ToTensor, Normalize), the tiny CNN for 32x32, batch 32,
  the default callbacks, 0 and 2 DataLoader workers.
- ``ddp``: the tiny CNN in 2 gloo processes (one thread each), the global batch split over them.
- ``imports``: what ``import basetrainer`` (and the trainer / callback modules) adds to
  ``import torch, torchvision``.
- ``data``: images/s of examples/example.py's train loader with 0 and 2 workers.
- ``seeding``: CPU time of per-sample seeding per item and per batch (default loader, 0 workers).
- ``costs``: the time each callback spends per event, in one instrumented run per setting.
- ``writes``: what resnet18_on's epoch-end checkpoint (the snapshot, then the files written in
  the background) costs the training that goes on meanwhile.

Each loop case runs ``--rounds`` times (default 5), each round in a fresh Python process with
its own timed pairs, the cases taking turns; a case's figure is the median over all its pairs,
with a bootstrap 95% interval, in CPU time (this process's threads and its DataLoader workers;
summed over ranks in DDP) and in wall time. The loop comparisons on in-memory tensors also
check that basetrainer's per-epoch loss and final weights equal the hand-written loop's. The
method is described in docs/benchmarks.md and bench/loop_contenders.py.
"""
import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import torch  # noqa: E402

import loop_contenders as lc  # noqa: E402
import loop_probes as probes  # noqa: E402
import loop_docs as docs  # noqa: E402
import loop_report as report  # noqa: E402

CANONICAL = ".venv/bin/python bench/bench_loop.py --out docs"
LOOP_CASES = ("tiny_off", "tiny_on", "regression", "resnet18_off", "resnet18_on", "digits_w0", "digits_w2", "ddp")
OTHER_CASES = ("imports", "data", "seeding", "costs", "writes")
GROUPS = {"tiny": ("tiny_off", "tiny_on"), "resnet18": ("resnet18_off", "resnet18_on"), "resnet": ("resnet18_off",
          "resnet18_on"), "digits": ("digits_w0", "digits_w2"), "all": LOOP_CASES + OTHER_CASES}
# targets on the CPU-time ratio's median (the interval is reported beside it)
TARGETS = {"tiny_off": 1.05, "tiny_on": 1.10, "regression": 1.10, "resnet18_off": 1.02, "resnet18_on": 1.02,
           "digits_w0": 1.05, "digits_w2": 1.05, "ddp": 1.05}
# what each case's basetrainer side is given, for the tables
SETUPS = {"tiny_off": "default loader, no callbacks", "tiny_on": "default loader, default callbacks",
          "regression": "default loader, no callbacks", "resnet18_off": "default loader, no callbacks",
          "resnet18_on": "default loader, default callbacks",
          "digits_w0": "default loader (0 workers), default callbacks",
          "digits_w2": "default loader (2 persistent workers), default callbacks",
          "ddp": "default loader, no callbacks, 2 processes"}
# glibc's malloc moves its mmap threshold up to the size of each large block freed (and its trim
# threshold with it), so how fast an epoch allocates depends on what the process freed before:
# 8 resnet18 steps took 0.86 s or 0.68 s on the 2-core machine depending only on whether 90 MB
# of tensors had just been freed. Both contenders run in one process, one after the other, so
# that history lands on whichever runs next. Fixed thresholds (the most the adaptive ones
# can reach on 64-bit glibc) make every run start from the same allocator behaviour.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
# Each loop case runs in ROUNDS fresh processes, the cases taking turns (round 1 of every case,
# then round 2, ...), and its pairs are pooled. One process, or one stretch of time, can favour
# a contender for its whole length (where its memory landed, a busy spell of the machine);
# with 25 and 15 pairs in one process the medians of three runs still differed by more than
# the spread of their pairs allows (resnet18_on 1.003, 1.009, 1.027).
ROUNDS = 5


def plan(quick: bool) -> Dict[str, Tuple[lc.Spec, int, int]]:
    """Each loop case: (spec, timed repeats, epochs of the untimed warm-up/equality pair)."""
    tiny_n = 64 * (30 if quick else 100)
    res_n = 64 if quick else 256
    res_epochs = 1 if quick else 2
    digits_n = 1437    # the digits train folder (examples/prepare_data.py: 80% of 1797)
    # Timed pairs per round (see ROUNDS). On the 2-core machine one tiny_on pair's ratio spreads
    # over 0.73-1.38 and a resnet18_on pair's over 0.76-1.36; with 9 pairs in one process a run's
    # median moved 1.06-1.11 and 1.00-1.03, and with 25 and 15 pairs in one process still
    # 1.078-1.093 and 1.003-1.027: as wide as the margin to the target.
    tiny_reps, res_reps, ddp_reps, digits_reps = (3, 2, 3, 2) if quick else (6, 3, 4, 3)
    return {
        "tiny_off": (lc.Spec("tiny_cnn", tiny_n, 64, 2, callbacks=False), tiny_reps, 2),
        "tiny_on": (lc.Spec("tiny_cnn", tiny_n, 64, 2, callbacks=True), tiny_reps, 2),
        "regression": (lc.Spec("mlp", 353, 32, 10 if quick else 30, callbacks=False, lr=0.01, task="regress"),
                       tiny_reps, 2),
        "resnet18_off": (lc.Spec("resnet18", res_n, 32, res_epochs, callbacks=False), res_reps, 1),
        "resnet18_on": (lc.Spec("resnet18", res_n, 32, res_epochs, callbacks=True), res_reps, 1),
        "digits_w0": (lc.Spec("tiny_cnn32", digits_n, 32, 1, callbacks=True, data="digits"), digits_reps, 1),
        "digits_w2": (lc.Spec("tiny_cnn32", digits_n, 32, 1, callbacks=True, data="digits", workers=2),
                      digits_reps, 1),
        "ddp": (lc.Spec("tiny_cnn", tiny_n, 64, 2, callbacks=False, world=2), ddp_reps, 2),
    }


def steps_per_epoch(spec: lc.Spec) -> int:
    """Optimizer steps per epoch of one process (DistributedSampler pads to equal shards)."""
    per_rank = math.ceil(spec.samples / spec.world)
    return math.ceil(per_rank / (spec.batch_size // spec.world))


def describe(spec: lc.Spec, repeats: int, rounds: int = 1) -> str:
    """One line saying what a loop case trains."""
    pairs = f"{rounds} x {repeats} timed pairs (fresh process per round)" if rounds > 1 else f"{repeats} timed pairs"
    data = ("the digits ImageFolder (example's transforms)" if spec.data == "digits"
            else f"in-memory tensors {'x'.join(map(str, lc.INPUT_SHAPES.get(spec.model, ())))}")
    return (f"{spec.model} on {data}, {spec.samples} samples/epoch, global batch {spec.batch_size}, "
            f"{steps_per_epoch(spec)} steps/epoch, {spec.epochs} epoch(s) per run, {pairs}, "
            f"{spec.workers} worker(s), callbacks {'on' if spec.callbacks else 'off'}, {spec.world} process(es)")


def run_ddp(spec: lc.Spec, repeats: int, warmup_epochs: int) -> Dict[str, Any]:
    """Both contenders in one 2-process gloo group started by basetrainer's ``launch``."""
    from basetrainer.engine.launch import launch

    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as tmp:
        out_file = os.path.join(tmp, "ddp.json")
        try:
            launch(lc.ddp_entry, num_gpus_per_machine=spec.world, dist_url="auto", distributed=True,
                   args=(spec, repeats, warmup_epochs, out_file), backend="gloo", timeout=600)
        except Exception as e:  # a rank that dies in teardown, after the figures were written
            if not os.path.isfile(out_file):
                raise
            print(f"    warning: a DDP process ended abnormally after writing its figures ({e})", flush=True)
        with open(out_file, encoding="utf-8") as f:
            return json.load(f)


def run_loop_case(name: str, spec: lc.Spec, repeats: int, warmup_epochs: int,
                  say: Callable[[str], None]) -> Dict[str, Any]:
    """Run one loop comparison (in this process, or in 2 DDP processes) and add its metadata."""
    if spec.world > 1:
        result = run_ddp(spec, repeats, warmup_epochs)
    else:
        result = lc.compare(spec, repeats, warmup_epochs, "default" if spec.callbacks else "none", progress=say)
    result.update({"steps": steps_per_epoch(spec), "samples": spec.samples, "target": TARGETS[name],
                   "world": spec.world, "load": report.load_average(), "setup": SETUPS[name],
                   "workers": spec.workers})
    return result


def run_round(name: str, args: argparse.Namespace, say: Callable[[str], None]) -> Dict[str, Any]:
    """One round of loop case ``name`` in a fresh Python process (``--round-of``)."""
    with tempfile.TemporaryDirectory(prefix="bench_round_") as tmp:
        out = os.path.join(tmp, "round.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--round-of", name, "--json", out,
               "--threads", str(args.threads), "--malloc", args.malloc] + (["--quick"] if args.quick else [])
        lines: List[str] = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if line.startswith("    "):   # the per-pair lines
                    say(lines[-1])
        if proc.returncode != 0 or not os.path.isfile(out):
            tail = "\n".join(lines[-40:])
            raise SystemExit(f"bench_loop: round of {name} failed (exit {proc.returncode}):\n{tail}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def pool_rounds(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One case's figures from its rounds: the pairs of every round together."""
    pooled = dict(rounds[0])
    for key in ("b", "h", "ratios", "b_outside", "b_cpu", "h_cpu"):
        pooled[key] = [x for r in rounds for x in r[key]]
    pooled["loss_diff"] = max(r["loss_diff"] for r in rounds)
    pooled["weight_diff"] = max(r["weight_diff"] for r in rounds)
    pooled["load"] = max(r["load"] for r in rounds)
    pooled["round_medians"] = [statistics.median(r["ratios"]) for r in rounds]
    pooled["round_cpu_medians"] = [statistics.median(x / y for x, y in zip(r["b_cpu"], r["h_cpu"])) for r in rounds]
    return pooled


def run_costs(specs: Dict[str, Tuple[lc.Spec, int, int]], say: Callable[[str], None]) -> Dict[str, Any]:
    """One instrumented run of each callbacks-on case."""
    out = {}
    for name in ("tiny_on", "resnet18_on"):
        spec = specs[name][0]
        dataset, state = lc.make_dataset(spec), lc.initial_state(spec)
        handlers, result = probes.callback_costs(
            lambda patch: lc.run_basetrainer(spec, dataset, state, spec.epochs, "default", patch))
        out[name] = {"handlers": handlers, "epochs_s": sum(result.epoch_s)}
        top = next(iter(handlers.items()))
        say(f"    {name}: largest {top[0]} {top[1]['total_s'] * 1e3:.1f} ms over {sum(result.epoch_s):.2f} s of epochs")
    return out


SECTIONS = ("imports", "data", "seeding", "costs", "writes")


def merge_results(paths: List[str]) -> Dict[str, Any]:
    """The figures of several ``--json`` files: the first, plus the sections of the others.

    The commands of the later files are kept in ``extra_commands`` (with what they gave).
    """
    results: Dict[str, Any] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            part = json.load(f)
        if not results:
            results = part
            continue
        given = [k for k in SECTIONS if k in part] + list(part.get("cases", {}))
        for key in SECTIONS:
            if key in part:
                results[key] = part[key]
        results.setdefault("cases", {}).update(part.get("cases", {}))
        results.setdefault("specs", {}).update(part.get("specs", {}))
        results.setdefault("extra_commands", []).append(
            f"`{part.get('command', '?')}` ({', '.join(given)}; {part['machine']['date']}, "
            f"load {part['machine']['load_start']:.1f})")
    return results


def selected_cases(names: Optional[List[str]]) -> List[str]:
    """The cases named on the command line (groups expanded), in the canonical order."""
    chosen: List[str] = []
    for name in names or list(GROUPS["all"]):
        for case in GROUPS.get(name, (name,)):
            if case not in LOOP_CASES + OTHER_CASES:
                raise SystemExit(f"unknown case {name!r}; choose from "
                                 f"{sorted(set(LOOP_CASES + OTHER_CASES) | set(GROUPS))}")
            if case not in chosen:
                chosen.append(case)
    return [c for c in LOOP_CASES + OTHER_CASES if c in chosen]


def get_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repeats (about two minutes)")
    parser.add_argument("--cases", nargs="+", default=None, metavar="CASE",
                        help=f"cases to run (default all): {', '.join(LOOP_CASES + OTHER_CASES)}, "
                             "or the groups tiny, resnet18, all")
    parser.add_argument("--out", default=None, help="folder for benchmarks.md and benchmarks.png (e.g. docs)")
    parser.add_argument("--json", default=None, help="also write the raw figures to this JSON file")
    parser.add_argument("--readme", default=None, metavar="README",
                        help="also rewrite README's speed section (between its markers) with these figures")
    parser.add_argument("--render", nargs="+", default=None, metavar="JSON",
                        help="run nothing: print and write (--out) the figures of earlier --json files (the "
                             "sections of later files are added to, or replace, those of the first)")
    parser.add_argument("--malloc", choices=("fixed", "default"), default="fixed",
                        help="fixed (default): glibc's mmap and trim thresholds fixed for this process and "
                             "the DDP processes (MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=64 MiB; "
                             "the benchmark restarts itself with them), so no run inherits the allocator "
                             "state of the one before; default: glibc's adaptive thresholds")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"fresh processes per loop case, the cases taking turns (default {ROUNDS}; "
                             "1 with --quick)")
    parser.add_argument("--round-of", default=None, help=argparse.SUPPRESS)  # one round of one case
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in single-process cases (default 1: stable on a shared 2-core "
                             "machine; DDP processes always use 1)")
    return parser


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the chosen cases, print the tables and write the docs.

    Args:
        argv: the command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The raw figures (what ``--json`` writes).
    """
    argv = sys.argv[1:] if argv is None else argv
    args = get_parser().parse_args(argv)
    if args.malloc == "fixed" and not args.render and any(os.environ.get(k) != v for k, v in FIXED_MALLOC.items()):
        # glibc reads these when the process starts: start again with them (DDP processes inherit them)
        os.environ.update(FIXED_MALLOC)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + list(argv))
    cases = selected_cases(args.cases)
    torch.set_num_threads(args.threads)
    logging.getLogger("basetrainer").setLevel(logging.ERROR)  # e.g. "no CUDA device" from launch

    def say(msg: str) -> None:
        print(msg, flush=True)

    if args.render:
        results = merge_results(args.render)
        finish(results, args, results.get("command", CANONICAL), say)
        return results
    t_start = time.perf_counter()
    specs = plan(args.quick)
    if args.round_of:   # a round of one loop case, in this fresh process (run_round)
        spec, repeats, warmup = specs[args.round_of]
        result = run_loop_case(args.round_of, spec, repeats, warmup, say)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f)
        return result
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else ROUNDS)
    if rounds < 1:
        raise SystemExit(f"--rounds {rounds}: give at least 1")
    results: Dict[str, Any] = {"machine": report.machine_info(args.threads), "cases": {}, "specs": {},
                               "quick": args.quick}
    results["machine"]["malloc"] = (", ".join(f"{k}={os.environ.get(k)}" for k in FIXED_MALLOC)
                                    if args.malloc == "fixed" else "glibc's adaptive thresholds")
    say(f"bench_loop: {', '.join(cases)} on {results['machine']['cpu']} ({results['machine']['cores']} cores), "
        f"torch {results['machine']['torch']}, load {results['machine']['load_start']:.1f}")
    loop_cases = [c for c in cases if c in LOOP_CASES]
    done: Dict[str, List[Dict[str, Any]]] = {c: [] for c in loop_cases}
    for r in range(rounds):
        for name in loop_cases:
            t0 = time.perf_counter()
            say(f"[{name}, round {r + 1}/{rounds}]")
            done[name].append(run_round(name, args, say))
            say(f"    ({time.perf_counter() - t0:.0f} s)")
    for name in loop_cases:
        spec, repeats, _ = specs[name]
        results["specs"][name] = describe(spec, repeats, rounds)
        results["cases"][name] = pool_rounds(done[name])
    for name in cases:
        if name in LOOP_CASES:
            continue
        t0 = time.perf_counter()
        say(f"[{name}]")
        if name == "imports":
            results["imports"] = probes.import_times(2 if args.quick else 7, say)
        elif name == "data":
            results["data"] = probes.loader_throughput([0, 2], 1 if args.quick else 15, say=say)
        elif name == "seeding":
            results["seeding"] = probes.seeding_cost(3 if args.quick else 15, say)
        elif name == "costs":
            results["costs"] = run_costs(specs, say)
        elif name == "writes":
            results["writes"] = probes.write_interference(5 if args.quick else 21, say)
        say(f"    ({time.perf_counter() - t0:.0f} s)")
    results["total_s"] = time.perf_counter() - t_start
    results["load_end"] = report.load_average()
    shown = [a for i, a in enumerate(argv) if a != "--json" and (i == 0 or argv[i - 1] != "--json")]
    results["command"] = (".venv/bin/python bench/bench_loop.py " + " ".join(shown)).strip()  # --json: no figure
    finish(results, args, results["command"], say)
    return results


def finish(results: Dict[str, Any], args: argparse.Namespace, command: str, say: Callable[[str], None]) -> None:
    """Print the tables; write the JSON (--json) and docs (--out)."""
    say("")
    say(report.text_report(results))
    say(f"\ntotal {results['total_s']:.0f} s; load average {results['machine']['load_start']:.1f} at start, "
        f"{results['load_end']:.1f} at end")
    if args.json and not args.render:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        docs.write_markdown(os.path.join(args.out, "benchmarks.md"), results, command, CANONICAL)
        docs.write_png(os.path.join(args.out, "benchmarks.png"), results)
        say(f"wrote {os.path.join(args.out, 'benchmarks.md')} and {os.path.join(args.out, 'benchmarks.png')}")
    if args.readme:
        docs.write_readme(args.readme, results)
        say(f"wrote the speed section of {args.readme}")
    say("\nREADME paragraph:\n\n" + docs.readme_paragraph(results))


if __name__ == "__main__":
    main()
