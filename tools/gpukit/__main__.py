"""The GPU check kit: every GPU promise of basetrainer checked in one command.

    tools/gpu_check.sh OUT_DIR            # on the GPU machine: its python3, nothing installed
    tools/gpu_check.sh OUT_DIR --cpu      # the dry run: the same script on the CPU (CI runs it)
    tools/gpu_check.sh OUT_DIR --only clip_with_fp16_unscales_first resume_sigkill_mid_epoch

Writes OUT_DIR/report.md and OUT_DIR/report.json (each check: status pass/fail/skip, its figure
or the reason, seconds); the first line names torch, CUDA and the GPU, and says exactly why when
basetrainer does not import. Everything a check writes goes under OUT_DIR/work (and /tmp).

The checks run in a child process (:mod:`gpukit.child`), the correctness checks first, then the
speed benchmarks; a check that runs past its time limit (twice its budget on one H100, at least
a minute; in the dry run six times, at least 4 minutes) or crashes its process is reported as
failed and a new child takes the rest. Nothing runs past ``--deadline`` seconds (default 470 on
the GPU: the run ends within 8 minutes; 900 in the dry run): checks not started are reported as
skipped, a check still running then as failed. Exit status 0 when no check failed.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

from gpukit import registry, report


def _supervise(names: List[str], timeouts: Dict[str, float], results_file: str, tmp: str, device: str, dry: bool,
               deadline: float, log: Any) -> List[Dict[str, Any]]:
    """Run ``names`` in child processes; a new child after a timeout or a crash. No check
    starts less than 20 s before ``deadline``, and none runs past it."""
    done: List[Dict[str, Any]] = []
    pending = list(names)
    while pending:
        if time.monotonic() > deadline - 20:
            done += [{"name": n, "kind": "?", "status": "skip", "figure": {}, "seconds": 0.0,
                      "reason": "not started: the kit's deadline passed"} for n in pending]
            break
        seen = _count(results_file)
        cmd = [sys.executable, "-m", "gpukit.child", results_file, tmp, device] + (["--dry"] if dry else []) + pending
        # deterministic cuBLAS (the DDP and resume checks) needs this before the process's first cuBLAS call
        env = registry.child_env(CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
        child = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
        current, started = None, time.monotonic()
        while True:
            rc = child.poll()
            records = _read(results_file)[seen:]
            for rec in records:
                if "start" in rec:
                    current, started = rec["start"], time.monotonic()
                elif rec.get("name") in pending:
                    done.append(rec)
                    pending.remove(rec["name"])
                    _progress(rec)
                    current = None
            seen += len(records)
            if rc is not None:
                if current is not None or (pending and rc != 0):
                    name = current or pending[0]
                    done.append({"name": name, "kind": "?", "status": "fail", "figure": {}, "seconds":
                                 round(time.monotonic() - started, 1), "reason": f"its process ended with status {rc}"})
                    pending.remove(name)
                break
            if current is not None and (time.monotonic() - started > timeouts[current] or time.monotonic() > deadline):
                child.kill()
                child.wait()
                why = f"timed out after {timeouts[current]:.0f} s" if time.monotonic() - started > timeouts[current] \
                    else "stopped at the kit's deadline"
                done.append({"name": current, "kind": "?", "status": "fail", "figure": {}, "seconds":
                             round(time.monotonic() - started, 1), "reason": why})
                pending.remove(current)
                seen = _count(results_file)
                break
            time.sleep(0.2)
    return done


def _read(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _count(path: str) -> int:
    return len(_read(path))


def _progress(rec: Dict[str, Any]) -> None:
    print(f"{rec['status']:4} {rec['name']} ({rec['seconds']:.1f} s) {registry.figure_text(rec.get('figure'))} "
          f"{rec.get('reason', '')[:300]}", flush=True)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpukit", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--cpu", action="store_true", help="the dry run: every check on the CPU (CUDA-only ones skip)")
    parser.add_argument("--only", nargs="+", default=None, help="run these checks only")
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which no check starts")
    args = parser.parse_args(argv)
    start = time.monotonic()
    out_dir = os.path.abspath(args.out_dir)
    tmp = os.path.join(out_dir, "work")
    os.makedirs(tmp, exist_ok=True)
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(tmp, "matplotlib"))
    info = report.machine()
    print(report.headline(info, args.cpu), flush=True)
    try:
        checks = registry.load_all()
    except Exception as e:   # the child reports it per check; the names are needed here
        print(f"the checks do not import: {type(e).__name__}: {e}", flush=True)
        checks = {}
    names = args.only or [c.name for c in checks.values() if c.kind == "check"] + \
        [c.name for c in checks.values() if c.kind == "bench"]
    unknown = [n for n in names if n not in checks]
    if unknown and checks:
        parser.error(f"unknown check(s) {unknown}; choose from {list(checks)}")
    device = "cpu" if args.cpu else "cuda"
    results: List[Dict[str, Any]] = []
    if not args.cpu and not info.get("cuda_available"):
        results = [{"name": n, "kind": "?", "status": "fail", "figure": {}, "seconds": 0.0,
                    "reason": "no CUDA device (run with --cpu for the dry run)"} for n in names]
    else:
        # the dry run's CPU (2 cores, shared) is far slower than the GPU machine: its own limits
        scale, least = (6.0, 240.0) if args.cpu else (2.0, 60.0)
        timeouts = {n: max(least, scale * checks[n].budget_s) if n in checks else least for n in names}
        deadline = start + (args.deadline or (900.0 if args.cpu else 470.0))   # 8 minutes on the GPU, less the exit
        with open(os.path.join(out_dir, "checks.log"), "w") as log:
            results = _supervise(names, timeouts, os.path.join(out_dir, "results.jsonl"), tmp, device, args.cpu,
                                 deadline, log)
    for r in results:
        if r["kind"] == "?" and r["name"] in checks:
            r["kind"] = checks[r["name"]].kind
    order = {n: i for i, n in enumerate(names)}
    results.sort(key=lambda r: order.get(r["name"], len(order)))
    headline = report.write(out_dir, info, results, args.cpu, time.monotonic() - start)
    failed = [r["name"] for r in results if r["status"] == "fail"]
    print(f"{headline}\n{len(results) - len(failed)} of {len(results)} checks did not fail"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; report: {out_dir}/report.md", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
