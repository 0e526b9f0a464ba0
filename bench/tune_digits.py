"""Issue 37's acceptance search: 12 trials over examples/example.py on the digits (small input,
few epochs per trial), against the default config's run, and the best trial's checkpoint
evaluated again.

    python bench/tune_digits.py [--work_dir work_space/tune_digits] [--trials 12] [--num_epochs 3]
        [--input_size 16 16] [--net_type resnet18] [--gpu_id]        # --gpu_id with no id: the CPU

Prints the default config's figure, the best trial's, the trials complete/pruned/failed, the
total time, and the best trial's checkpoint's figure from ``example.py --eval_only`` (it must
equal the trial's). The search's table and plots stay in work_dir (trials.md, history.png,
importance.png). Rerunning the command continues the search (the study is work_dir/study.db).
"""
import argparse
import csv
import glob
import os
import re
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "example.py")
SPACE = {
    "objective": "Accuracy",
    "pruner": {"type": "median", "n_startup_trials": 3, "n_warmup_steps": 1},
    "seed": 0,
    "params": {
        "lr": {"low": 0.003, "high": 0.3, "log": True},
        "weight_decay": {"low": 0.0, "high": 0.001},
        "optim_type": {"choices": ["SGD", "AdamW"]},
        "batch_size": {"choices": [32, 64]},
    },
}


def run(cmd, log):
    """``cmd`` to its end, its output in ``log``; the output as text."""
    with open(log, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}).returncode
    with open(log) as f:
        text = f.read()
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}; see {log}:\n{text[-2000:]}")
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work_dir", default=os.path.join(ROOT, "work_space", "tune_digits"))
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--num_epochs", type=int, default=3)
    p.add_argument("--input_size", nargs=2, type=int, default=[16, 16])
    p.add_argument("--net_type", default="resnet18")
    p.add_argument("--gpu_id", nargs="*", type=int, default=[0], help="GPU ids; none given: the CPU")
    args = p.parse_args()
    work = os.path.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)
    script_args = ["-c", os.path.join(ROOT, "configs", "config.yaml"), "--input_size", *map(str, args.input_size),
                   "--num_epochs", str(args.num_epochs), "--net_type", args.net_type, "--no-progress",
                   "--loggers", "csv", "--gpu_id", *map(str, args.gpu_id)]

    began = time.monotonic()
    default_dir = os.path.join(work, "default")
    if not glob.glob(os.path.join(default_dir, "model", "best_model_*.pth")):
        run([sys.executable, EXAMPLE, *script_args, "--work_dir", default_dir, "--overwrite"],
            os.path.join(work, "default.log"))
    default_figure = max(float(m) for m in re.findall(r"best_model_\d+_([0-9.]+)\.pth",
                                                      " ".join(os.listdir(os.path.join(default_dir, "model")))))
    default_seconds = time.monotonic() - began

    space_file = os.path.join(work, "search.yaml")
    with open(space_file, "w") as f:
        yaml.safe_dump({**SPACE, "trials": args.trials, "work_dir": os.path.join(work, "search")}, f)
    began = time.monotonic()
    run([sys.executable, "-m", "basetrainer.tune", EXAMPLE, "--space", space_file, *script_args],
        os.path.join(work, "search.log"))
    search_seconds = time.monotonic() - began

    search_dir = os.path.join(work, "search")
    with open(os.path.join(search_dir, "trials.csv")) as f:
        rows = list(csv.DictReader(f))
    states = [r["state"] for r in rows]
    best = max((r for r in rows if r["state"] == "complete"), key=lambda r: float(r["value"]))
    folder = os.path.join(search_dir, "trials", f"{int(best['number']):03d}")
    weights = sorted(glob.glob(os.path.join(folder, "model", "best_model_*.pth")))[-1]
    text = run([sys.executable, EXAMPLE, "-c", os.path.join(search_dir, "best.yaml"), "--eval_only", "--resume",
                weights, "--work_dir", os.path.join(work, "evaluate")], os.path.join(work, "evaluate.log"))
    again = float(re.search(r"test/Accuracy ([0-9.]+)", text).group(1))

    print(f"default config ({args.net_type}, {args.input_size[0]}x{args.input_size[1]}, {args.num_epochs} epochs): "
          f"test/Accuracy {default_figure:.4f} ({default_seconds:.0f} s)")
    print(f"search: {len(rows)} trials: {states.count('complete')} complete, {states.count('pruned')} pruned, "
          f"{states.count('fail')} failed, {states.count('interrupted')} interrupted; {search_seconds:.0f} s")
    params = {k: best[k] for k in SPACE["params"]}
    print(f"best trial {best['number']}: test/Accuracy {float(best['value']):.4f} {params}")
    print(f"best trial's checkpoint {os.path.relpath(weights, work)} evaluated again: test/Accuracy {again:.4f} "
          f"({'equal' if abs(again - float(best['value'])) < 1e-4 else 'DIFFERENT'})")
    print(f"table and plots: {search_dir}/trials.md, history.png, importance.png")


if __name__ == "__main__":
    main()
