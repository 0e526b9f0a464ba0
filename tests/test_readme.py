"""README runs as printed.

Every fenced block says what it is (``bash`` commands, a ``python`` script, or ``text`` that is not
run); the python script runs as printed (its flags parse in the quick loop; it trains, with
smaller settings given by its own flags, in the slow tests); every command names files, scripts,
modules, extras and flags that exist (each script's ``--help`` is read in this process); and the
figure the Quickstart quotes, with its spread over seeds, and the imbalanced table (a mean over
seeds) are the ones ``bench/readme_figures.py`` measured (docs/figures.md).

The Quickstart's first command at full length (6 epochs of resnet18) is what
``bench/readme_figures.py`` runs and records; tests/test_example.py runs the same script on tiny data.
"""
import contextlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from typing import List, Tuple

import pytest

from conftest import ROOT

KINDS = {"bash", "python", "text"}
# the folders of this repository: a code span naming a path under them names a file that must exist
TRACKED = ("examples/", "bench/", "basetrainer/", "tests/", "docs/", "configs/", "tools/", ".ci/")
# the script the Quickstart trains with: a code span that is only flags (`--resume auto`) is its flags
QUICKSTART_SCRIPT = "examples/example.py"
# what the test passes to README's trainer script: its own flags, smaller than its defaults
SAMPLE_FLAGS = ["--num_epochs", "1", "--input_size", "8", "8"]
SAMPLE_FILE = "train.py"      # what README tells the reader to save its python block as


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def fenced_blocks(markdown: str) -> List[Tuple[str, str]]:
    """(language, text) of each fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\S*)\n(.*?)^```\s*$", markdown, re.S | re.M)]


def prose(markdown: str) -> str:
    """The markdown less its fenced and indented blocks (output shown, not typed)."""
    text = re.sub(r"^```.*?^```\s*$", "", markdown, flags=re.S | re.M)
    return re.sub(r"^(?: {4}|\t).*$", "", text, flags=re.M)


def code_spans(markdown: str) -> List[str]:
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose(markdown))]


def commands(markdown: str, inline: bool) -> List[str]:
    """The commands a page gives: each line of its bash blocks (comments dropped, ``&&`` split),
    and with ``inline`` the code spans in its text that start with a program; a span of flags
    alone (`--resume auto`) is a command of the Quickstart's script."""
    out = []
    for kind, text in fenced_blocks(markdown):
        if kind == "bash":
            for line in text.splitlines():
                out += [part.strip() for part in line.split("#", 1)[0].split("&&") if part.strip()]
    if inline:
        for span in code_spans(markdown):
            program = re.sub(r"^(\w+=(\"[^\"]*\"|\S+) )+", "", span)          # VAR=value ./setup.sh
            if re.match(r"\./setup\.sh\b|((\.venv/bin/)?python3?|pip|torchrun|\.venv/bin/\w+) ", program):
                out += [part.strip() for part in span.split("&&")]
            elif re.match(r"--\w", span):
                out.append(f"python {QUICKSTART_SCRIPT} {span}")
    return out


def help_text(target: List[str]) -> str:
    """``--help`` of ``python <target>`` (a script, or ``-m module``), run in this process."""
    argv, path, out = list(sys.argv), list(sys.path), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            if target[0] == "-m":
                sys.argv = [target[1], "--help"]
                runpy.run_module(target[1], run_name="__main__", alter_sys=True)
            else:
                script = os.path.join(ROOT, target[0])
                sys.argv = [script, "--help"]
                runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv[:], sys.path[:] = argv, path
    assert exit_.value.code in (0, None), f"python {' '.join(target)} --help exited {exit_.value.code}"
    return out.getvalue()


def check_command(command: str) -> None:
    """The program, script or module a command names exists and takes the flags it is given."""
    words = shlex.split(command)
    env = []
    while re.match(r"\w+=", words[0]):
        env.append(words.pop(0).split("=", 1)[0])
    program = words[0]
    if program == "./setup.sh":
        assert os.access(os.path.join(ROOT, "setup.sh"), os.X_OK), command
        for name in env:                                              # the variables it reads
            assert re.search(rf"\${{{name}[:}}]", _read("setup.sh")), f"{command}: setup.sh does not read {name}"
        return
    assert not env, f"{command}: environment variables for {program}"
    if program == "pip":
        assert words[1] == "install", command
        extras = _pyproject()["project"]["optional-dependencies"]
        for word in words[2:]:
            match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", word)      # the checkout, with extras
            if match:
                for extra in filter(None, (match.group(1) or "").split(",")):
                    assert extra in extras, f"{command}: no extra {extra!r} in pyproject.toml ({sorted(extras)})"
            pin = re.fullmatch(r"(torch|torchvision)==(\S+)", word)   # the tested versions
            if pin:
                assert f"{pin.group(1)}=={pin.group(2)}" in _read(".ci/floor-constraints.txt"), command
        return
    if program.startswith(".venv/bin/") and not re.search(r"/python3?$", program):
        tool = os.path.basename(program)                              # mkdocs: its config is here
        assert tool == "mkdocs" and os.path.isfile(os.path.join(ROOT, "mkdocs.yml")), command
        return
    assert re.search(r"(^|/)(python3?|torchrun)$", program), f"{command}: unknown program {program!r}"
    args = words[1:]
    while args and args[0].startswith("--nproc"):                    # torchrun's own options
        args = args[2:]
    if args[:1] == ["-m"]:
        module, flags = args[1], args[2:]
        if module == "pytest":
            return
        assert importlib.util.find_spec(module) is not None, f"{command}: no module {module}"
        target = ["-m", module]
    else:
        script, flags = args[0], args[1:]
        target = [script]
        if script != SAMPLE_FILE:
            assert os.path.isfile(os.path.join(ROOT, script)), f"{command}: no file {script}"
    shown = sample_help() if target == [SAMPLE_FILE] else help_text(target)
    for flag in (word.split("=", 1)[0] for word in flags if word.startswith("--")):
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", shown), f"{command}: {target[-1]} has no flag {flag}"


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def trainer_sample() -> str:
    blocks = [text for kind, text in fenced_blocks(_read("README.md")) if kind == "python"]
    assert len(blocks) == 1, f"README has {len(blocks)} python blocks; this test runs the trainer script"
    return blocks[0]


# ---------------------------------------------------------------------------------- quick
@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/install.md"])
def test_every_block_says_what_it_is(page):
    blocks = fenced_blocks(_read(page))
    assert blocks, page
    for kind, text in blocks:
        assert kind in KINDS, f"{page}: a fenced block marked {kind!r} (one of {sorted(KINDS)}):\n{text[:300]}"
        if kind == "python":
            compile(text, page, "exec")


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/install.md"])
def test_commands_name_scripts_and_flags_that_exist(page):
    markdown = _read(page)
    found = commands(markdown, inline=page == "README.md")
    assert found, page
    for command in found:
        check_command(command)
    for span in code_spans(markdown):
        path = span.split()[0]
        if path.startswith(TRACKED) and re.fullmatch(r"[\w./-]+", path):
            assert os.path.exists(os.path.join(ROOT, path)), f"{page} names {path}, which does not exist"


def test_readme_commands_are_found():
    """The extraction itself: README's commands, the ones this file checks, are all seen."""
    found = commands(_read("README.md"), inline=True)
    assert "./setup.sh" in found and ".venv/bin/python examples/example.py" in found
    assert any(c.startswith("python -m basetrainer.deploy ") and "--check" in c for c in found), found
    assert f"python {QUICKSTART_SCRIPT} --resume auto" in found and any(c.startswith("pip install -e") for c in found)
    assert any(c.startswith("pip install torch==") and "--index-url" in c for c in found), found   # the CPU build
    install = commands(_read("docs/install.md"), inline=False)
    assert any(c.startswith("TORCH_SPEC=") and c.endswith("./setup.sh") for c in install), install


def sample_help() -> str:
    """README's python block, as printed, run up to its argument parser: its ``--help``."""
    code = compile(trainer_sample(), "README.md", "exec")
    argv, out = list(sys.argv), io.StringIO()
    try:
        sys.argv = [SAMPLE_FILE, "--help"]
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            exec(code, {"__name__": "__main__"})
    finally:
        sys.argv[:] = argv
    assert exit_.value.code == 0
    return out.getvalue()


def test_trainer_sample_parses_its_flags():
    shown = sample_help()
    for flag in ("--config_file", "--train_data", "--test_data", "--work_dir", "--gpu_id", "--resume", "--overwrite",
                 *[f for f in SAMPLE_FLAGS if f.startswith("--")]):
        assert flag in shown, flag


def test_trainer_sample_is_short():
    lines = trainer_sample().strip().splitlines()
    assert len(lines) <= 70, f"README's trainer is {len(lines)} lines: a newcomer pastes it whole"
    assert "..." not in trainer_sample()                                    # no placeholders


def _marked(markdown: str, name: str) -> str:
    match = re.search(rf"<!-- {name}: .*? -->\n(.*?)<!-- /{name} -->", markdown, re.S)
    assert match, f"no <!-- {name}: ... --> ... <!-- /{name} --> section"
    return match.group(1)


def _figures_script():
    spec = importlib.util.spec_from_file_location("readme_figures", os.path.join(ROOT, "bench", "readme_figures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quoted_figures_are_the_measured_ones():
    """README's and the front page's Quickstart figures are rendered from docs/figures.md, the
    output of bench/readme_figures.py (``--quote`` rewrites them), so they cannot disagree."""
    figures = _figures_script()
    measured = figures.parse_figures_md(_read("docs/figures.md"))
    for page, kind in (("README.md", "readme"), ("docs/index.md", "index")):
        assert _marked(_read(page), "quickstart-figure") == figures.quote(measured, kind), (
            f"{page}'s quoted figures differ from docs/figures.md: run python3 bench/readme_figures.py --quote")
    final = re.search(r"final test/Accuracy: (\d\.\d{4})", _read("README.md"))
    assert final and float(final.group(1)) == measured["final_accuracy"]
    # the line quoted is the default seed's, and the spread beside it is over at least three seeds
    seeds = measured["seeds"]
    assert len(seeds) >= 3 and seeds[0]["seed"] == 2020, seeds
    assert seeds[0]["final_accuracy"] == measured["final_accuracy"], seeds
    finals = [r["final_accuracy"] for r in seeds]
    known = {measured["final_accuracy"], measured["best_accuracy"], round(sum(finals) / len(finals), 4),
             *finals, *(r["best_accuracy"] for r in seeds)}
    for page in ("README.md", "docs/index.md", "docs/development.md", "docs/checkpoints.md"):
        text = re.sub(r"<!-- imbalanced-table: .*?<!-- /imbalanced-table -->", "", _read(page), flags=re.S)
        for number in re.findall(r"\b0\.9\d{3}\b", text):          # an accuracy of the Quickstart
            assert float(number) in known, (page, number)


def test_imbalanced_table_is_the_measured_one():
    """README's table of examples/imbalanced.py is the mean over the seeds docs/figures.md records
    (bench/readme_figures.py ran them), rendered by the script (``--quote`` rewrites it)."""
    figures = _figures_script()
    text = _read("docs/figures.md")
    measured = figures.parse_imbalanced(text)
    assert measured, "docs/figures.md has no examples/imbalanced.py runs: python3 bench/readme_figures.py --out docs"
    runs = measured["runs"]
    for balance in ("none", "sqrt"):
        assert len({r["seed"] for r in runs if r["balance"] == balance}) >= 3, (balance, runs)
    assert _marked(_read("README.md"), "imbalanced-table") == figures.imbalanced_quote(text), (
        "README's imbalanced table differs from docs/figures.md: run python3 bench/readme_figures.py --quote")


def test_deploy_table_is_the_deploy_commands_own():
    """README's latency table is the deploy command's latency table, as bench/export_latency.py
    recorded the command's whole output in docs/deploy.md (``--quote`` rewrites README from it):
    ms per image at the batch sizes the command names, the threads, and the ratio to eager."""
    spec = importlib.util.spec_from_file_location("export_latency", os.path.join(ROOT, "bench", "export_latency.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    deploy = _read("docs/deploy.md")
    output = _marked(deploy, "deploy-output")
    assert "`python " + " ".join(bench.COMMAND) + "`" in output, "docs/deploy.md's output is not of bench's command"
    table = bench.latency_table(output)
    assert table.startswith("Latency on the CPU, 1 thread: median of 30 timed runs after 5 warm-up rounds"), table
    assert "| format | precision | batch 1, ms (IQR) | vs eager | batch 32, ms per image (IQR) | vs eager |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| pytorch", "| onnx", "| onnx-fp16", "| onnx-int8", "| mnn",
                                                 "| ncnn", "| ncnn-fp16", "| openvino"], rows
    assert rows[0].count("1.00×") == 2, rows[0]              # eager is the reference of its own ratio
    quoted = _marked(_read("README.md"), "deploy-table")
    assert quoted == bench.readme_quote(deploy), (
        "README's latency table differs from docs/deploy.md: run python bench/export_latency.py --quote")
    assert table in quoted


def test_imbalanced_cells_are_means_with_their_range():
    """A cell of the table is the mean over the seeds and, where they differ, their min–max."""
    figures = _figures_script()
    runs = [{"seed": seed, "balance": "none", "recall": {"0": r0, "1": 1.0}, "accuracy": acc,
             "balanced_accuracy": acc} for seed, r0, acc in ((2020, 0.25, 0.5), (1, 0.5, 0.75), (2, 0.75, 1.0))]
    rows = figures.imbalanced_table({"runs": runs}).splitlines()
    assert rows[0] == "| balance | recall 0 | 1 | accuracy | balanced accuracy |"
    assert rows[2] == "| none | 0.500 (0.250–0.750) | 1.000 | 0.7500 (0.5000–1.0000) | 0.7500 (0.5000–1.0000) |"


# ---------------------------------------------------------------------------------- slow
@pytest.mark.distributed
@pytest.mark.slow
def test_trainer_sample_trains_as_printed(tmp_path):
    """README's python block saved as train.py, run where the Quickstart left data/digits,
    with its own flags for one short epoch: it prints one line per epoch and writes its run."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from prepare_data import prepare_digits
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    prepare_digits(str(tmp_path / "data" / "digits"))
    (tmp_path / SAMPLE_FILE).write_text(trainer_sample())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, SAMPLE_FILE, *SAMPLE_FLAGS], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    epochs = re.findall(r"epoch (\d+)/(\d+) done: .*test/Accuracy: ([0-9.]+)", out)
    assert [(e, n) for e, n, _ in epochs] == [("0", "1")], out[-4000:]
    assert float(epochs[0][2]) >= 0.5, out[-4000:]           # 10 classes: chance is 0.1; 0.77 measured
    run_dir = tmp_path / "work_space" / "trainer"
    assert (run_dir / "model" / "last.pth").is_file() and (run_dir / "log" / "train.log").is_file()
    assert "epoch 0/1 done" in (run_dir / "log" / "train.log").read_text()
