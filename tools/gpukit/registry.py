"""The checks of the GPU kit: how one is declared, what it is given, what it returns.

A check is a plain function ``fn(ctx) -> figure`` (a dict of numbers and short strings) that
asserts its figure itself (``assert``, so pytest shows the values; the kit's runner reports the
message) and raises :class:`Skip` with a reason when it cannot run here. The same function is a
pytest test (``tests/test_gpu.py`` wraps every check under the ``gpu`` marker) and a kit check
(``python -m gpukit``): nothing here imports pytest, which the GPU machine does not have.

``ctx.device`` is ``cuda`` on the GPU machine and ``cpu`` in the dry run (``--cpu``); a check
whose assertion has a CPU side runs it on the CPU, one without raises :class:`Skip`
(:func:`need_cuda`).
"""
import dataclasses
import os
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch


class Skip(Exception):
    """The check cannot run here; the message says why: ``needs CUDA: ...`` (no CPU side) or
    ``missing package: ...`` (an optional package this machine lacks)."""


@dataclasses.dataclass
class Context:
    """What a check is given: the device, a folder of its own, the dry-run flag."""

    device: torch.device
    tmp: str
    cpu_dry_run: bool = False

    def size(self, full: int, dry: int) -> int:
        """``full`` on the GPU machine, ``dry`` in the CPU dry run (a few steps: the path runs)."""
        return dry if self.cpu_dry_run else full

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def gpu_id(self) -> List[int]:
        """The config's ``gpu_id`` for this device (``[]``: the CPU)."""
        return [self.device.index or 0] if self.cuda else []

    def folder(self, name: str) -> str:
        path = os.path.join(self.tmp, name)
        os.makedirs(path, exist_ok=True)
        return path


@dataclasses.dataclass
class Check:
    name: str
    fn: Callable[[Context], Dict[str, Any]]
    budget_s: float              # the most it may take on one H100 (the runner kills it past 2x, min 60 s)
    kind: str = "check"          # check | bench
    processes: bool = False      # starts processes (pytest: the distributed marker)
    doc: str = ""


CHECKS: Dict[str, Check] = {}


def check(name: str, budget_s: float, kind: str = "check", processes: bool = False) -> Callable:
    """Register ``fn`` as the check ``name`` (unique), with its time budget on one H100."""
    def register(fn: Callable[[Context], Dict[str, Any]]) -> Callable[[Context], Dict[str, Any]]:
        if name in CHECKS:
            raise ValueError(f"check {name!r} is registered twice ({CHECKS[name].fn.__module__} and {fn.__module__})")
        CHECKS[name] = Check(name, fn, budget_s, kind, processes, (fn.__doc__ or "").strip().split("\n\n")[0])
        return fn
    return register


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = [ROOT, os.path.join(ROOT, "tools"), os.path.join(ROOT, "tests")]   # basetrainer, gpukit, the test toys


def child_env(**extra: str) -> Dict[str, str]:
    """The environment of a process a check starts: this one's, with the tree's folders first on
    ``PYTHONPATH`` (so the child imports this tree's basetrainer, gpukit and test toys)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(PATHS + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def need_cuda(ctx: Context, why: str) -> None:
    """Skip a check that has no CPU side (``why``: what it needs CUDA for)."""
    if not ctx.cuda:
        raise Skip(f"needs CUDA: {why}")


def load_all() -> Dict[str, Check]:
    """Import every check module (they register themselves) and return the checks in order."""
    from gpukit import checks_train, checks_state, checks_dist, checks_speed  # noqa: F401  (their order is the run's)

    return CHECKS


def run_one(check_: Check, ctx: Context) -> Dict[str, Any]:
    """Run one check: ``{"name", "kind", "status": pass|fail|skip, "figure", "seconds", "reason"}``."""
    start = time.perf_counter()
    result: Dict[str, Any] = {"name": check_.name, "kind": check_.kind, "figure": {}, "reason": ""}
    try:
        result["figure"] = check_.fn(ctx) or {}
        result["status"] = "pass"
    except Skip as e:
        result["status"], result["reason"] = "skip", str(e)
    except Exception as e:   # an assertion (the figure is in its message) or an error
        result["status"] = "fail"
        result["reason"] = f"{type(e).__name__}: {e}"[:2000]
        result["traceback"] = traceback.format_exc()[-4000:]
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def figure_text(figure: Optional[Dict[str, Any]]) -> str:
    """A figure dict as one line: ``a=1.2e-07, b=0.98``."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, (list, tuple)) and all(isinstance(x, float) for x in v):
            return "[" + ", ".join(f"{x:.4g}" for x in v) + "]"
        return str(v)
    return ", ".join(f"{k}={fmt(v)}" for k, v in (figure or {}).items())
