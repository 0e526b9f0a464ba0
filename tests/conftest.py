"""Toys shared by the tests: tiny models, in-memory data, a recording callback, a toy trainer,
image folders on disk, the one weight comparison (:func:`weight_diff`), the one way to train a
script in a subprocess (:func:`script_fixture`, :func:`run_script`, :func:`start_script`), and a
helper that runs a function in N gloo processes on 127.0.0.1.

Markers: a test that starts processes (gloo ranks, launchers, scripts in subprocesses) is marked
``distributed``; one that trains for more than a few seconds ``slow``. ``pytest -m "not slow and
not distributed"`` is the quick loop; CI runs everything."""
import os
import socket
import subprocess
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Union

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import basetrainer
from basetrainer.callbacks.callbacks import Callback
from basetrainer.engine import trainer as trainer_mod
from basetrainer.utils import setup_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class TinyNet(nn.Module):
    """A 2-layer MLP on 16 features (no BatchNorm: exact DDP equivalence)."""

    def __init__(self, num_classes: int = 4, in_features: int = 16, hidden: int = 32, bn: bool = False) -> None:
        super().__init__()
        layers: List[nn.Module] = [nn.Linear(in_features, hidden)]
        if bn:
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.ReLU(), nn.Linear(hidden, num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def blobs(n: int = 128, num_classes: int = 4, dim: int = 16, seed: int = 0, noise: float = 0.5) -> TensorDataset:
    """Gaussian blobs around fixed class centres: linearly separable with a little noise."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(1234)) * 3
    y = torch.arange(n) % num_classes
    x = centres[y] + noise * torch.randn(n, dim, generator=g)
    return TensorDataset(x, y)


class Recorder(Callback):
    """Records every event (name and arguments that are numbers) and copies of ``logs``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: List[tuple] = []
        self.epoch_logs: List[dict] = []
        self.lrs: List[float] = []

    def _add(self, name: str, *args: Any) -> None:
        self.events.append((name,) + tuple(a for a in args if isinstance(a, int)))

    def on_train_begin(self, logs=None): self._add("on_train_begin")
    def on_train_end(self, logs=None): self._add("on_train_end")
    def on_epoch_begin(self, epoch, logs=None): self._add("on_epoch_begin", epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._add("on_epoch_end", epoch)
        self.epoch_logs.append(dict(logs))

    def on_batch_prepare(self, epoch, batch, logs=None): self._add("on_batch_prepare", epoch, batch)

    def on_batch_begin(self, batch, logs=None):
        self._add("on_batch_begin", batch)
        self.lrs.append(self.trainer.optimizer.param_groups[0]["lr"])

    def on_batch_end(self, batch, logs=None): self._add("on_batch_end", batch)
    def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None): self._add("on_train_summary", epoch, batch)
    def on_test_begin(self, logs=None): self._add("on_test_begin")
    def on_test_summary(self, inputs, outputs, losses, epoch, batch, logs=None): self._add("on_test_summary", epoch, batch)
    def on_test_end(self, logs=None): self._add("on_test_end")


class ToyTrainer(trainer_mod.EngineTrainer):
    """An EngineTrainer on blobs with TinyNet. ``cfg`` keys: n_train, n_test, num_classes,
    shuffle, bn, extra callbacks via ``callbacks`` argument."""

    def __init__(self, cfg: Any, callbacks: Optional[List[Any]] = None, model: Optional[nn.Module] = None) -> None:
        super().__init__(cfg)
        self._extra = callbacks or []
        self._model = model
        self.build(self.cfg)

    def build_train_loader(self, cfg, **kwargs):
        ds = blobs(cfg.get("n_train", 128), cfg.get("num_classes", 4), seed=0)
        return self.build_dataloader(ds, cfg.batch_size, cfg.num_workers, phase="train",
                                     shuffle=cfg.get("shuffle", True), drop_last=cfg.get("drop_last", False))

    def build_test_loader(self, cfg, **kwargs):
        n = cfg.get("n_test", 0)
        if not n:
            return None
        return self.build_dataloader(blobs(n, cfg.get("num_classes", 4), seed=1), cfg.batch_size, 0, phase="test",
                                     shuffle=False)

    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        model = self._model or TinyNet(cfg.get("num_classes", 4), bn=cfg.get("bn", False))
        return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)

    def build_criterion(self, cfg, **kwargs):
        return nn.CrossEntropyLoss()

    def build_optimizer(self, cfg, **kwargs):
        return torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.get("momentum", 0.0))

    def build_callbacks(self, cfg, **kwargs):
        return list(self._extra)


def toy_cfg(**overrides: Any) -> setup_config.Config:
    """A small config: CPU, no progress bars, 2 epochs, batch 16, lr 0.1."""
    cfg = setup_config.Config(gpu_id=[], progress=False, num_epochs=2, batch_size=16, lr=0.1, log_freq=2,
                              work_dir="", seed=0)
    cfg.update(overrides)
    return cfg


class StopAt(Callback):
    """Raises ``RuntimeError("stopped on purpose")`` after step ``batch`` of ``epoch`` (after
    that step's checkpoint), like a crash."""

    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at = (epoch, batch)

    def on_batch_end(self, batch, logs=None):
        if (self.trainer.epoch, batch) == self.at:
            raise RuntimeError("stopped on purpose")


def make_image_folder(root: str, classes: List[str], per_class: int = 4, size: int = 8) -> str:
    """Write ``per_class`` small PNGs per class under ``root/<class>/``."""
    from PIL import Image
    import numpy as np

    rng = np.random.default_rng(0)
    for ci, name in enumerate(classes):
        folder = os.path.join(root, name)
        os.makedirs(folder, exist_ok=True)
        for i in range(per_class):
            pixels = (rng.random((size, size)) * 60 + ci * 40).astype("uint8")
            Image.fromarray(pixels, mode="L").save(os.path.join(folder, f"{i}.png"))
    return root


Weights = Union[nn.Module, Dict[str, torch.Tensor]]


def weight_diff(a: Weights, b: Weights) -> float:
    """The largest absolute difference between two models' weights (modules or state dicts,
    compared in float64; NaN where either holds NaN, so ``weight_diff(...) <= tol`` fails then).

    Fails the test when the names or shapes differ. ``== 0.0`` is bitwise equality of values.
    """
    a = a.state_dict() if isinstance(a, nn.Module) else a
    b = b.state_dict() if isinstance(b, nn.Module) else b
    assert a.keys() == b.keys(), f"weights differ in names: only in a {sorted(a.keys() - b.keys())}, " \
                                 f"only in b {sorted(b.keys() - a.keys())}"
    worst = 0.0
    for k in a:
        x, y = torch.as_tensor(a[k]).detach().cpu(), torch.as_tensor(b[k]).detach().cpu()
        assert x.shape == y.shape, f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if x.numel():
            d = float((x.double() - y.double()).abs().max())
            if d != d:
                return d
            worst = max(worst, d)
    return worst


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _preload_forkserver() -> None:
    """run_distributed starts its ranks from a fork server that imported torch and this file
    once (each spawned rank would import them again: about 3 s of every multi-process test)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "conftest", "basetrainer.engine.trainer"])


_preload_forkserver()
