"""README's latency table, made by the deploy command itself.

Usage, from the root of a checkout, after the Quickstart's first command trained the example::

    python bench/export_latency.py            # run the command below, print its output and the machine
    python bench/export_latency.py --write    # also put it into docs/deploy.md and README.md
    python bench/export_latency.py --quote    # only rewrite README's table from docs/deploy.md

The one thing timed is README's deploy command with the timing flags below (``COMMAND``): every
format is exported and checked against eager PyTorch, then eager PyTorch and the exports take
turns, one call each per round, so load from other processes slows all of them alike. The
command prints the latency table (per call at batch 1, per image at batch 32, the interquartile
range, the ratio to eager, the threads); docs/deploy.md holds its whole output between
``<!-- deploy-output: ... -->`` and ``<!-- /deploy-output -->``, under the date, commit, CPU and
load average, and README's table between ``<!-- deploy-table: ... -->`` and
``<!-- /deploy-table -->`` is that output's latency table, copied (tests/test_readme.py checks
that they agree). The command times the CPU formats: CUDA ONNX Runtime and TensorRT are not timed.
"""
import argparse
import datetime
import os
import re
import subprocess
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python")
PY = PY if os.path.exists(PY) else sys.executable
# README's command (python -m basetrainer.deploy work_space/digits/model/last.pth --check
# data/digits/val), every CPU format, one thread for every runtime, README's batch of 32
COMMAND = ["-m", "basetrainer.deploy", "work_space/digits/model/last.pth",
           "--format", "onnx,onnx-fp16,onnx-int8,mnn,ncnn,ncnn-fp16,openvino", "--check", "data/digits/val",
           "--threads", "1", "--batch", "32", "--runs", "30", "--warmup", "5", "--out-dir", "output/export_latency"]
OUTPUT = re.compile(r"(<!-- deploy-output: [^\n]*-->\n)(.*?)(<!-- /deploy-output -->)", re.S)
TABLE = re.compile(r"(<!-- deploy-table: [^\n]*-->\n)(.*?)(<!-- /deploy-table -->)", re.S)
LATENCY_TITLE = "Latency on the CPU"


def machine() -> str:
    """CPU model and cores, torch, commit and date: what the figures were measured on."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    torch_version, gpu = (subprocess.run([PY, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
                                         capture_output=True, text=True, timeout=120).stdout.split() + ["?", "?"])[:2]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return f"{now} at {commit}, {cpu}, {os.cpu_count()} cores, {'a' if gpu == 'True' else 'no'} GPU, torch {torch_version}"


def latency_table(output: str) -> str:
    """The latency table of the deploy command's output: its title line, a blank line, the table."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(LATENCY_TITLE)), None)
    if start is None:
        raise SystemExit(f"no '{LATENCY_TITLE}' table in the deploy command's output (docs/deploy.md's "
                         f"deploy-output section is empty, or the command ran with --runs 0): "
                         f"python bench/export_latency.py --write")
    end = start + 2
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end]) + "\n"


def readme_quote(deploy_md: str) -> str:
    """README's section: where the table comes from, then the command's latency table."""
    match = OUTPUT.search(deploy_md)
    if not match:
        raise SystemExit("docs/deploy.md has no '<!-- deploy-output: ... -->' section: python bench/export_latency.py --write")
    header = re.search(r"^Measured (.*?):$", match.group(2), re.M)
    return (f"The digits resnet18 at 32×32, timed by the command above with one thread, batch 32 and 30 runs "
            f"(`python bench/export_latency.py`, {header.group(1) if header else 'see docs/deploy.md'}; "
            f"[all of its output](docs/deploy.md#latency)):\n\n" + latency_table(match.group(2)))


def rewrite(path: str, pattern: "re.Pattern[str]", body: str) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not pattern.search(text):
        name = pattern.pattern.split(": ", 1)[0].split("<!-- ", 1)[1]
        raise SystemExit(f"{path} has no '<!-- {name}: ... -->' ... '<!-- /{name} -->' section: put both markers "
                         f"back where the table goes")
    with open(path, "w", encoding="utf-8") as f:
        f.write(pattern.sub(lambda m: m.group(1) + body + m.group(3), text, count=1))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="put the output into docs/deploy.md and README.md")
    parser.add_argument("--quote", action="store_true", help="only rewrite README's table from docs/deploy.md")
    args = parser.parse_args(argv)
    deploy_md, readme = os.path.join(ROOT, "docs", "deploy.md"), os.path.join(ROOT, "README.md")
    if not args.quote:
        if not os.path.isfile(os.path.join(ROOT, COMMAND[2])):
            parser.error(f"{COMMAND[2]} does not exist: train the example first (python examples/example.py)")
        where, before = machine(), os.getloadavg()[0]
        proc = subprocess.run([PY, *COMMAND], cwd=ROOT, capture_output=True, text=True)
        after = os.getloadavg()[0]
        sys.stderr.write(proc.stderr[-3000:] if proc.returncode else "")
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            return proc.returncode
        body = (f"`python {' '.join(COMMAND)}`\n\nMeasured {where}, load average {before:.1f} → {after:.1f}:\n\n"
                + proc.stdout + "\nCUDA ONNX Runtime and TensorRT: not timed (the command times the CPU formats).\n")
        print(f"\n{where}, load average {before:.1f} -> {after:.1f}")
        if not args.write:
            return 0
        rewrite(deploy_md, OUTPUT, body)
    with open(deploy_md, encoding="utf-8") as f:
        rewrite(readme, TABLE, readme_quote(f.read()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
