"""Toys shared by the tests (tiny models, in-memory data, a recording callback, a toy trainer,
image folders on disk, the one weight comparison :func:`weight_diff`: defined in ``toys.py``,
which needs no pytest, and re-exported here), the one way to train a script in a subprocess
(:func:`script_fixture`, :func:`run_script`, :func:`start_script`), and a helper that runs a
function in N gloo processes on 127.0.0.1.

Markers: a test that starts processes (gloo ranks, launchers, scripts in subprocesses) is marked
``distributed``; one that trains for more than a few seconds ``slow``. ``pytest -m "not slow and
not distributed"`` is the quick loop; CI runs everything."""
import os
import subprocess
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

import basetrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the toys live in toys.py (no pytest there: the GPU kit imports them too); tests import them from here
from toys import (Recorder, StopAt, TinyNet, ToyTrainer, blobs, free_port, make_image_folder,  # noqa: E402,F401
                  toy_cfg, weight_diff)


def script_fixture(text: str, name: str) -> Any:
    """A module-scoped fixture: the path of ``text`` written as ``name`` in a fresh temporary
    folder (``{tests}`` and ``{root}`` in ``text`` become the tests folder and the repository,
    for the script's ``sys.path``; write other braces doubled). Use: ``script =
    script_fixture(SCRIPT, "train_toy.py")`` at module level, then :func:`run_script`."""
    @pytest.fixture(scope="module")
    def script(tmp_path_factory: Any) -> str:
        path = tmp_path_factory.mktemp("script") / name
        path.write_text(text.format(tests=os.path.join(ROOT, "tests"), root=ROOT))
        return str(path)

    return script


def run_script(script: str, *args: Any, env: Optional[Dict[str, str]] = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``python script args...`` with this interpreter, to its end (output captured as text);
    a run longer than ``timeout`` seconds fails the test (subprocess.TimeoutExpired)."""
    return subprocess.run([sys.executable, script, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def start_script(script: str, *args: Any, env: Optional[Dict[str, str]] = None,
                 new_session: bool = False) -> subprocess.Popen:
    """``python script args...`` started and not waited for (pipes for its output, text), in
    its own process group with ``new_session`` (as under SLURM: signals go to the group)."""
    return subprocess.Popen([sys.executable, script, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=new_session)



def _dist_entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple, result_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import datetime
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, *args)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.barrier()  # leave together (gloo may abort a rank that tears down early)
    except BaseException:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        import gc

        gc.collect()  # free the DDP model (a trainer <-> callbacks cycle) so the group's threads join here
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, tmp_path: Any, *args: Any, timeout: float = 120) -> List[Any]:
    """Run ``fn(rank, *args)`` in ``world_size`` gloo processes; return each rank's result.

    ``fn`` must be defined at module level (it is pickled into spawned processes) and return
    something ``torch.save`` can write. Fails the test with the rank's traceback on error, and
    never hangs longer than ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    result_dir = str(tmp_path / f"dist_results_{fn.__name__}")
    os.makedirs(result_dir, exist_ok=True)
    ctx = mp.start_processes(_dist_entry, args=(fn, world_size, free_port(), args, result_dir), nprocs=world_size,
                             join=False, start_method="forkserver")
    import time
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout} s")
    except Exception:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        errors = [open(os.path.join(result_dir, f)).read() for f in sorted(os.listdir(result_dir)) if f.endswith(".err")]
        pytest.fail(f"distributed run failed:\n" + "\n".join(errors or [traceback.format_exc()]))
    return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(autouse=True)
def _processes_need_the_marker(request: Any, monkeypatch: Any) -> None:
    """With ``BASETRAINER_CHECK_MARKERS=1``: a test not marked ``distributed`` that starts a
    process (a subprocess, or a multiprocessing process other than a DataLoader worker or a
    fork server) fails, naming it, so the quick loop stays quick. Off by default; processes
    started by a module- or session-scoped fixture happen before it and are not seen."""
    if os.environ.get("BASETRAINER_CHECK_MARKERS") != "1" or request.node.get_closest_marker("distributed"):
        return
    import multiprocessing.process

    where = request.node.nodeid

    def refuse(what: str) -> None:
        pytest.fail(f"{where} starts a process ({what}) but is not marked @pytest.mark.distributed")

    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def popen(self: Any, args: Any, *a: Any, **k: Any) -> None:
        if args not in (["true"], ("true",)):   # a process that exits at once, for a dead pid
            refuse(f"subprocess {args!r:.80}")
        popen_init(self, args, *a, **k)

    def start(self: Any) -> None:
        target = getattr(getattr(self, "_target", None), "__qualname__", "")
        if target not in ("_worker_loop",) and "forkserver" not in type(self).__module__:
            refuse(f"process {target or type(self).__name__}")
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)


def pytest_report_header(config: Any) -> str:
    return f"basetrainer {basetrainer.__version__} from {os.path.dirname(basetrainer.__file__)}"


def pytest_xdist_auto_num_workers(config: Any) -> int:
    """pyproject.toml's ``-n auto``: two pytest-xdist workers (measured on CI's two cores:
    docs/development.md), none on one core, and none when the command names single tests
    (``path::name``): pytest's own process runs them at once, and says "not found" for a
    misspelt name (under xdist a run of a misspelt name ends with only "no tests ran")."""
    if any("::" in str(arg) for arg in config.args):
        return 0
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 0


def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:
    """CI (.ci/run) runs the slow and distributed tests of its FLOOR_FILES in the floor
    environment only, and names those files in ``BASETRAINER_FLOOR_RUNS`` for the run in the
    newest one, which leaves them out here: each test runs once per CI run, not twice. Unset (a
    user's ``pytest``), every collected test runs."""
    elsewhere = set(os.environ.get("BASETRAINER_FLOOR_RUNS", "").split())
    if not elsewhere:
        return
    keep, left = [], []
    for item in items:
        moved = item.nodeid.split("::", 1)[0] in elsewhere and (
            item.get_closest_marker("slow") or item.get_closest_marker("distributed"))
        (left if moved else keep).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep
        _FLOOR_ONLY.append(len(left))


_FLOOR_ONLY: List[int] = []


def pytest_terminal_summary(terminalreporter: Any, config: Any) -> None:
    """The line that says what CI left out here. Under pytest-xdist the workers collect and the
    controller (which prints) holds no items, so the line has no count there."""
    if _FLOOR_ONLY or (os.environ.get("BASETRAINER_FLOOR_RUNS", "").strip()
                       and getattr(config.option, "numprocesses", None)):
        count = f"{_FLOOR_ONLY[0]}" if _FLOOR_ONLY else "the"
        terminalreporter.write_line(f"{count} slow or distributed tests of BASETRAINER_FLOOR_RUNS's files were left "
                                    "out here: CI runs them in its floor environment")


def _preload_forkserver() -> None:
    """run_distributed starts its ranks from a fork server that imported torch and this file
    once (each spawned rank would import them again: about 3 s of every multi-process test)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "conftest", "basetrainer.engine.trainer"])


_preload_forkserver()
