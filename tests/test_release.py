"""What a release carries: the license in the repository, the wheel and the sdist; lower bounds
in pyproject.toml that CI has run; a CHANGELOG; README naming the tested versions."""
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest

from conftest import ROOT

import basetrainer

CONSTRAINTS = os.path.join(ROOT, ".ci", "floor-constraints.txt")


def _license_text() -> str:
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        return f.read()


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_license_file_is_the_mit_text():
    text = _license_text()
    assert text.startswith("MIT License\n")
    assert re.search(r"^Copyright \(c\) \d{4} \S", text, re.M)
    assert "Permission is hereby granted, free of charge" in text
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in text
    project = _pyproject()["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A wheel (``pip wheel``) and an sdist built from a copy of the source (the checkout's own
    tree keeps no build/ or egg-info from this)."""
    root = tmp_path_factory.mktemp("release")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if os.path.exists(os.path.join(ROOT, name)):
            shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "basetrainer"), src / "basetrainer",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = root / "dist"
    env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(src)], capture_output=True, text=True, env=env, timeout=300)
    assert wheel.returncode == 0, wheel.stdout + wheel.stderr
    sdist = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; "
                            f"print(build_meta.build_sdist({str(out)!r}))"],
                           cwd=str(src), capture_output=True, text=True, timeout=300)
    assert sdist.returncode == 0, sdist.stdout + sdist.stderr
    wheels = sorted(out.glob("*.whl"))
    sdists = sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, os.listdir(out)
    return wheels[0], sdists[0]


@pytest.mark.distributed
def test_wheel_carries_the_license(built):
    wheel, _ = built
    version = basetrainer.__version__
    assert wheel.name == f"basetrainer-{version}-py3-none-any.whl"
    info = f"basetrainer-{version}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert f"{info}/licenses/LICENSE" in names, sorted(n for n in names if ".dist-info/" in n)
        assert z.read(f"{info}/licenses/LICENSE").decode("utf-8") == _license_text()
        metadata = z.read(f"{info}/METADATA").decode("utf-8")
    assert "License-Expression: MIT" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    assert "Requires-Python: >=3.11" in metadata.splitlines()
    assert {"basetrainer/__init__.py", "basetrainer/py.typed",
            "basetrainer/callbacks/progress_bar.py"} <= names
    assert not any(n.startswith(("tests/", "examples/", "bench/")) for n in names)


@pytest.mark.distributed
def test_sdist_carries_the_license(built):
    _, sdist = built
    top = f"basetrainer-{basetrainer.__version__}"
    with tarfile.open(sdist) as t:
        assert f"{top}/LICENSE" in t.getnames(), t.getnames()[:20]
        member = t.extractfile(f"{top}/LICENSE")
        assert member is not None and member.read().decode("utf-8") == _license_text()


def _lower_bounds() -> dict:
    """Every requirement of pyproject.toml (dependencies and extras) -> its ">=" bound."""
    project = _pyproject()["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    bounds = {}
    for req in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", req)
        assert match, f"{req!r}: every requirement states the lowest version CI ran, as name>=version"
        name = match.group(1).lower().replace("_", "-")
        assert bounds.setdefault(name, match.group(2)) == match.group(2), f"two bounds for {name}"
    return bounds


def _floor_pins() -> dict:
    pins = {}
    with open(CONSTRAINTS, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_lower_bounds_are_the_versions_ci_installs_in_its_floor_environment():
    assert _lower_bounds() == _floor_pins()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert "CONSTRAINTS=.ci/floor-constraints.txt" in ci and "VENV=.venv-floor" in ci


def test_the_floor_environment_runs_test_files_that_exist():
    # .ci/run's floor environment runs the quick loop and FLOOR_FILES whole: a file renamed or
    # removed would silently leave the floor versions of its packages untested
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    listed = re.search(r"^FLOOR_FILES=\(([^)]*)\)", ci, re.M)
    assert listed, "FLOOR_FILES=(...) not found in .ci/run"
    files = listed.group(1).split()
    assert len(files) >= 10 and '"${FLOOR_FILES[@]}"' in ci and '-m "not slow and not distributed"' in ci
    missing = [f for f in files if not os.path.isfile(os.path.join(ROOT, f))]
    assert not missing, f"FLOOR_FILES in .ci/run names test files that do not exist: {missing}"


@pytest.mark.distributed
def test_the_two_ci_runs_together_run_every_test_once():
    # .ci/run: the first suite with BASETRAINER_FLOOR_RUNS, the floor's -m "slow or distributed" run
    # of FLOOR_FILES; conftest's hook must leave out exactly what the second run selects
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert 'BASETRAINER_FLOOR_RUNS="${FLOOR_FILES[*]}" suite .venv\n' in ci
    assert 'suite .venv-floor -m "slow or distributed" "${FLOOR_FILES[@]}"' in ci
    files = ["tests/test_docs.py", "tests/test_tune.py"]

    def collected(*args, **env):
        done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *args, *files],
                              cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "BASETRAINER_FLOOR_RUNS": "", **env})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return {line for line in done.stdout.splitlines() if "::" in line}

    everything = collected()
    first = collected(BASETRAINER_FLOOR_RUNS=" ".join(files))
    floor = collected("-m", "slow or distributed")
    assert len(everything) >= 15 and first and floor
    assert first.isdisjoint(floor) and first | floor == everything


def test_requires_python_is_the_tested_interpreter():
    assert _pyproject()["project"]["requires-python"] == ">=3.11"
    assert sys.version_info >= (3, 11)


def test_readme_states_the_tested_versions():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for name, version in _floor_pins().items():     # each floor CI runs, by name and version
        assert re.search(rf"\b{re.escape(name)} {re.escape(version)}\b", readme, re.I), (name, version)
    assert "Python 3.11" in readme and "Python 3.9+" not in readme
    assert "CHANGELOG.md" in readme


def test_changelog_has_the_releases():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        text = f.read()
    headings = re.findall(r"^## \[?([^\]\s]+)\]?", text, re.M)
    assert headings[0] == "Unreleased"
    assert basetrainer.__version__ in headings
    assert "1.0" in text   # 2.0's changes are told against Pytorch-Base-Trainer 1.0.x


@pytest.mark.distributed
def test_the_tests_run_in_two_workers_and_a_named_test_in_pytests_process():
    # pyproject's "-n auto" with conftest's pytest_xdist_auto_num_workers: a whole file in two
    # workers; a test named path::name in pytest's own process, where a misspelt name is
    # "not found" (under xdist it was only "no tests ran", exit 5)
    def pytest_run(*args):
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, env={**os.environ, "PYTEST_ADDOPTS": ""})
        return done.returncode, done.stdout + done.stderr

    rc, out = pytest_run("tests/test_release.py::test_requires_python_is_the_tested_interpreter")
    assert rc == 0 and "1 passed" in out and "workers" not in out, out[-2000:]
    rc, out = pytest_run("tests/test_release.py::test_misspelt_name")
    assert rc == 4 and "ERROR: not found: " in out and "test_misspelt_name" in out, out[-2000:]
    rc, out = pytest_run("tests/test_scheduler.py", "--pdb")   # xdist's "auto" gives --pdb no worker
    assert rc == 0 and "workers" not in out and " passed" in out, out[-2000:]
    rc, out = pytest_run("tests/test_scheduler.py")
    workers = "created: 2/2 workers" if len(os.sched_getaffinity(0)) >= 2 else "collected"
    assert rc == 0 and workers in out and " passed" in out, out[-2000:]
