"""Benchmark ``strategy: fsdp`` against ``strategy: ddp``: memory per process and step time.

    .venv/bin/python bench/bench_fsdp.py --out docs       # everything; writes docs/fsdp.md
    .venv/bin/python bench/bench_fsdp.py --quick          # a short run of everything
    .venv/bin/python bench/bench_fsdp.py --cases memory   # some cases only

Every case runs in 2 gloo processes on the CPU (started by basetrainer's ``launch``), one
torch thread per process. Cases (``--cases``):

- ``memory``: a stack of 12 residual ``Linear(2048, 2048)`` blocks (50.4 M parameters) trained
  with AdamW for a few steps on random in-memory data (global batch 8, 16 input features: the
  activations are negligible). Each rank's figure is the increase of its resident set (RSS) from
  just before ``build_model`` builds the model to its peak (``VmHWM`` of /proc/self/status,
  reset through /proc/self/clear_refs; a sampling thread where that does not work), in fresh
  processes for every run. Target: fsdp's largest rank <= 0.6x ddp's largest rank.
- ``tiny``: a BlockNet (tests/fsdp_common.py's shape: 16 -> 24, 3 residual blocks, 4 classes),
  global batch 64; the cost of FSDP's per-block collectives where there is little compute.
- ``resnet18``: torchvision's resnet18 (weights=None, 10 classes) at 32x32, global batch 32,
  a few hundred samples.

The step-time cases report the epoch-time ratio fsdp/ddp (median of paired runs that alternate
ddp, fsdp, fsdp, ddp, ... in one process group, no callbacks, progress off, no files); it is a
figure, not a target. They also check that both strategies train to the same parameters.
"""
import argparse
import ctypes
import gc
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from loop_report import _table, load_average, machine_info  # noqa: E402

CANONICAL = ".venv/bin/python bench/bench_fsdp.py --out docs"
CASES = ("memory", "tiny", "resnet18")
WORLD = 2
SEED = 2020
MEMORY_TARGET = 0.6
MiB = 2 ** 20


# ----------------------------------------------------------------------------- models and data
class Block(nn.Module):
    """``x + tanh(fc(x))``: what fully_shard wraps one by one."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class BlockNet(nn.Module):
    """``in_features`` -> width -> ``depth`` residual blocks -> classes."""

    def __init__(self, width: int, depth: int, in_features: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x))))


def resnet18_32() -> nn.Module:
    """torchvision's resnet18, random weights, 10 classes (run at 32x32)."""
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=10)


#: name -> (model factory, input shape, classes)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...], int]] = {
    "big": (lambda: BlockNet(2048, 12, 16, 10), (16,), 10),
    "tiny": (lambda: BlockNet(24, 3, 16, 4), (16,), 4),
    "resnet18": (resnet18_32, (3, 32, 32), 10),
}


def make_dataset(model: str, samples: int) -> TensorDataset:
    """Random inputs whose labels a fixed random linear map decides (a learnable task)."""
    _, shape, classes = MODELS[model]
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(samples, *shape, generator=g)
    w = torch.randn(x[0].numel(), classes, generator=g)
    return TensorDataset(x, (x.flatten(1) @ w).argmax(dim=1))


def count_params(model: str) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in MODELS[model][0]().parameters())


# ----------------------------------------------------------------------------- memory probes
def proc_status() -> Dict[str, int]:
    """VmRSS, VmHWM and RssFile (file-backed pages: library code) of this process, in bytes."""
    out = {"RssFile": 0}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssFile:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def malloc_trim() -> bool:
    """Give glibc's free heap memory back to the system (False where there is no glibc)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


class PeakMeter:
    """The peak RSS since :meth:`reset`: the kernel's VmHWM, reset by writing 5 to
    /proc/self/clear_refs (Linux); where that fails (or does not bring VmHWM down to VmRSS),
    a thread that samples VmRSS every millisecond."""

    def __init__(self) -> None:
        self.method = "VmHWM (reset via /proc/self/clear_refs)"
        self._peak = 0
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        if not self._clear_refs():
            self.method = "VmRSS sampled every 1 ms in a thread"
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    @staticmethod
    def _clear_refs() -> bool:
        try:
            before = proc_status()
            if before["VmHWM"] <= before["VmRSS"] + MiB:   # nothing to prove yet: make a peak, free it
                blob = bytearray(64 * MiB)   # above 32 MiB: freeing it leaves glibc's mmap threshold alone
                blob[::4096] = b"\1" * len(blob[::4096])
                del blob
                malloc_trim()
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            after = proc_status()
            return after["VmHWM"] <= after["VmRSS"] + MiB
        except OSError:
            return False

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, proc_status()["VmRSS"])
            time.sleep(0.001)

    def reset(self) -> int:
        """Start a new peak; return the RSS now."""
        if self._thread is None:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
        rss = proc_status()["VmRSS"]
        self._peak = rss
        return rss

    def peak(self) -> int:
        if self._thread is None:
            return proc_status()["VmHWM"]
        return max(self._peak, proc_status()["VmRSS"])

    def close(self) -> None:
        self._stop.set()


def local_bytes(tensors: Any) -> int:
    """Bytes this process holds of ``tensors`` (a DTensor's local shard only)."""
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type != "meta":
            total += local.numel() * local.element_size()
    return total


# ----------------------------------------------------------------------------- the trainer
def base_cfg(strategy: str, batch_size: int, epochs: int) -> Dict[str, Any]:
    return {"strategy": strategy, "gpu_id": [], "distributed": True, "batch_size": batch_size,
            "num_epochs": epochs, "lr": 1e-3, "log_freq": 1000, "progress": False, "work_dir": "",
            "seed": SEED, "num_workers": 0}


class EpochClock:
    """Marks the start (``set_epoch``) and end (``on_epoch_end``) of every epoch."""

    def __init__(self) -> None:
        self.starts: List[float] = []
        self.ends: List[float] = []


def make_trainer(cfg: Dict[str, Any], model_name: str, dataset: TensorDataset,
                 before_model: Optional[Callable[[], None]] = None) -> Any:
    """An EngineTrainer on ``dataset`` with AdamW and no callbacks but an epoch clock.

    ``before_model`` runs in ``build_model`` just before the model is made (the memory baseline).
    """
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.engine.trainer import EngineTrainer

    clock = EpochClock()

    class ClockCallback(Callback):
        def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
            clock.ends.append(time.perf_counter())

    class FsdpBenchTrainer(EngineTrainer):
        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            self.clock = clock
            self.build(self.cfg)

        def set_epoch(self, epoch: int) -> None:
            clock.starts.append(time.perf_counter())
            super().set_epoch(epoch)

        def build_train_loader(self, cfg: Any, **kwargs: Any) -> DataLoader:
            return self.build_dataloader(dataset, cfg.batch_size, 0, phase="train", shuffle=True,
                                         seed_per_sample=False)

        def build_test_loader(self, cfg: Any, **kwargs: Any) -> None:
            return None

        def build_model(self, cfg: Any, **kwargs: Any) -> nn.Module:
            if before_model is not None:
                before_model()
            torch.manual_seed(cfg.seed)   # the same initial weights (rank 0's) for both strategies
            model = MODELS[model_name][0]()
            return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)

        def build_criterion(self, cfg: Any, **kwargs: Any) -> nn.Module:
            return nn.CrossEntropyLoss()

        def build_optimizer(self, cfg: Any, **kwargs: Any) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.01)

        def build_callbacks(self, cfg: Any, **kwargs: Any) -> List[Any]:
            return [ClockCallback()]

    return FsdpBenchTrainer(cfg)


def full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The whole parameters on every rank (a collective per parameter under fsdp)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.named_parameters()}


def _quiet_worker() -> None:
    torch.set_num_threads(1)
    logging.getLogger("basetrainer").setLevel(logging.ERROR)


# ----------------------------------------------------------------------------- memory case
def memory_entry(strategy: str, samples: int, batch_size: int, trim: bool, out_file: str) -> None:
    """One measurement, in each of the fresh processes of a group: build, train, read the peaks."""
    from basetrainer.callbacks.callbacks import Callback

    _quiet_worker()
    meter = PeakMeter()
    dataset = make_dataset("big", samples)
    marks: Dict[str, Any] = {}
    trace: List[int] = []

    def before_model() -> None:
        gc.collect()
        marks["trimmed"] = malloc_trim() if trim else False
        marks["baseline"] = meter.reset()
        marks["baseline_file"] = proc_status()["RssFile"]

    class StepTrace(Callback):   # reads /proc only: allocates nothing that shows
        def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
            trace.append(proc_status()["VmRSS"] - marks["baseline"])

    trainer = make_trainer(base_cfg(strategy, batch_size, 1), "big", dataset, before_model)
    trainer.callbacks.append(StepTrace())
    marks["build_peak"] = meter.peak()
    marks["after_build"] = proc_status()["VmRSS"]
    params_b = local_bytes(trainer.model.parameters())
    meter.reset()
    trainer.run()
    marks["train_peak"] = meter.peak()
    marks["end"] = proc_status()["VmRSS"]
    state_b = local_bytes(t for s in trainer.optimizer.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor) and t.dim() > 0)
    gc.collect()
    malloc_trim()   # after the peaks: what is still resident once glibc returned its free memory
    end = proc_status()
    marks["end_trimmed"] = end["VmRSS"]
    base = marks["baseline"]
    figures = {"rank": dist.get_rank(), "baseline": base, "trimmed": marks["trimmed"],
               "build_inc": marks["build_peak"] - base, "after_build_inc": marks["after_build"] - base,
               "train_inc": marks["train_peak"] - base,
               "peak_inc": max(marks["build_peak"], marks["train_peak"]) - base,
               "end_inc": marks["end"] - base, "end_trimmed_inc": marks["end_trimmed"] - base,
               "end_file_inc": end["RssFile"] - marks["baseline_file"],
               "trace": trace, "param_bytes": params_b, "grad_bytes": params_b, "optim_bytes": state_b,
               "steps": trainer.global_step, "method": meter.method,
               "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "")}
    meter.close()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        with open(out_file, "w", encoding="utf-8") as f:
            json.dump(gathered, f)


def run_group(entry: Callable, args: Tuple, out_file: str, env: Optional[Dict[str, str]] = None) -> Any:
    """``entry(*args)`` in 2 fresh gloo processes (basetrainer's launch); the JSON rank 0 wrote."""
    from basetrainer.engine.launch import launch

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})   # the spawned processes inherit it (glibc reads MALLOC_* at start)
    try:
        launch(entry, num_gpus_per_machine=WORLD, dist_url="auto", distributed=True, args=args + (out_file,),
               backend="gloo", timeout=600)
    except Exception as e:  # a rank that dies in teardown, after the figures were written
        if not os.path.isfile(out_file):
            raise
        print(f"    warning: a process ended abnormally after writing its figures ({e})", flush=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with open(out_file, encoding="utf-8") as f:
        return json.load(f)


ALLOCATORS = ("default", "mmap")


def allocator_label(name: str, threshold: int) -> str:
    return "glibc default" if name == "default" else f"MALLOC_MMAP_THRESHOLD_={threshold}"


def run_memory(quick: bool, repeats: int, trim: bool, allocators: List[str], threshold: int,
               say: Callable[[str], None]) -> Dict[str, Any]:
    """Per allocator setting: fresh process groups in the order ddp, fsdp, fsdp, ddp, ...

    ``default``: glibc as it comes (its mmap threshold grows to the largest freed mmapped block,
    so later blocks up to 32 MiB come from the heap); ``mmap``: ``MALLOC_MMAP_THRESHOLD_`` fixed
    at ``threshold`` bytes in the processes (every larger block is its own mapping, returned
    when freed: RSS follows the live tensors).
    """
    batch_size = 8
    steps = 2 if quick else 4
    settings: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_") as tmp:
        for name in allocators:
            label = allocator_label(name, threshold)
            env = {"MALLOC_MMAP_THRESHOLD_": str(threshold)} if name == "mmap" else None
            if name == "default" and "MALLOC_MMAP_THRESHOLD_" in os.environ:
                say("    note: MALLOC_MMAP_THRESHOLD_ is set in this shell: 'glibc default' is not the default")
            say(f"  allocator: {label}")
            runs: Dict[str, List[List[Dict[str, Any]]]] = {"ddp": [], "fsdp": []}
            for i in range(repeats):
                for strategy in (("ddp", "fsdp") if i % 2 == 0 else ("fsdp", "ddp")):
                    out_file = os.path.join(tmp, f"mem_{name}_{strategy}_{i}.json")
                    ranks = run_group(memory_entry, (strategy, batch_size * steps, batch_size, trim), out_file, env)
                    runs[strategy].append(ranks)
                    say(f"    {strategy} run {i + 1}/{repeats}: peak increase per rank "
                        + ", ".join(f"{r['peak_inc'] / MiB:.0f}" for r in ranks) + " MiB (build "
                        + ", ".join(f"{r['build_inc'] / MiB:.0f}" for r in ranks) + "; train "
                        + ", ".join(f"{r['train_inc'] / MiB:.0f}" for r in ranks) + "; after the run, malloc_trim "
                        + ", ".join(f"{r['end_trimmed_inc'] / MiB:.0f}" for r in ranks) + ")")
            settings[label] = {"runs": runs, "method": runs["ddp"][0][0]["method"]}
    params = count_params("big")
    return {"settings": settings, "params": params, "steps": steps, "batch_size": batch_size, "trim": trim,
            "theory": {"ddp": 16 * params, "fsdp": 16 * params / WORLD}}


def memory_rows(runs_by: Dict[str, List[List[Dict[str, Any]]]]) -> Dict[str, Any]:
    """Per strategy and rank: the median over runs of each figure; the max over ranks."""
    out: Dict[str, Any] = {}
    for strategy, runs in runs_by.items():
        ranks = []
        for r in range(WORLD):
            per = [run[r] for run in runs]
            ranks.append({k: statistics.median(p[k] for p in per)
                          for k in ("baseline", "build_inc", "after_build_inc", "train_inc", "peak_inc", "end_inc",
                                    "end_trimmed_inc", "end_file_inc", "param_bytes", "grad_bytes", "optim_bytes")})
            ranks[-1]["spread"] = max(p["peak_inc"] for p in per) - min(p["peak_inc"] for p in per)
            ranks[-1]["trace"] = per[0]["trace"]
        out[strategy] = {"ranks": ranks, "max_peak": max(r["peak_inc"] for r in ranks)}
    if "ddp" in out and "fsdp" in out:
        out["ratio"] = out["fsdp"]["max_peak"] / out["ddp"]["max_peak"]
        out["meets"] = out["ratio"] <= MEMORY_TARGET
    return out


# ----------------------------------------------------------------------------- step-time cases
def timed_run(strategy: str, model: str, dataset: TensorDataset, batch_size: int, epochs: int,
              keep_params: bool = False) -> Tuple[float, Optional[Dict[str, torch.Tensor]]]:
    """Train ``epochs`` epochs; the run's epoch time (first start to last end / epochs)."""
    trainer = make_trainer(base_cfg(strategy, batch_size, epochs), model, dataset)
    trainer.run()
    clock = trainer.clock
    epoch_s = (clock.ends[-1] - clock.starts[0]) / len(clock.ends)
    params = full_params(trainer.unwrapped_model) if keep_params else None
    del trainer
    gc.collect()
    return epoch_s, params


def timing_entry(model: str, samples: int, batch_size: int, epochs: int, repeats: int, out_file: str) -> None:
    """Warm-up pair (1 epoch each: the parameters compared), then ``repeats`` timed pairs."""
    _quiet_worker()
    rank0 = dist.get_rank() == 0
    dataset = make_dataset(model, samples)
    _, p_ddp = timed_run("ddp", model, dataset, batch_size, 1, keep_params=True)
    _, p_fsdp = timed_run("fsdp", model, dataset, batch_size, 1, keep_params=True)
    diff = max(float((p_ddp[k] - p_fsdp[k]).abs().max()) for k in p_ddp)
    scale = max(float(p_ddp[k].abs().max()) for k in p_ddp)
    times: Dict[str, List[float]] = {"ddp": [], "fsdp": []}
    for i in range(repeats):
        for strategy in (("ddp", "fsdp") if i % 2 == 0 else ("fsdp", "ddp")):
            times[strategy].append(timed_run(strategy, model, dataset, batch_size, epochs)[0])
        if rank0:
            print(f"    repeat {i + 1}/{repeats}: ddp {times['ddp'][-1] * 1e3:8.1f} ms/epoch, "
                  f"fsdp {times['fsdp'][-1] * 1e3:8.1f} ms/epoch, ratio {times['fsdp'][-1] / times['ddp'][-1]:.3f}",
                  flush=True)
    if rank0:
        with open(out_file, "w", encoding="utf-8") as f:
            json.dump({"ddp": times["ddp"], "fsdp": times["fsdp"], "param_diff": diff, "param_scale": scale}, f)


def timing_plan(quick: bool) -> Dict[str, Dict[str, int]]:
    """Each step-time case: samples, global batch, epochs per run, timed pairs."""
    return {
        "tiny": {"samples": 64 * (20 if quick else 50), "batch_size": 64, "epochs": 2, "repeats": 3 if quick else 9},
        "resnet18": {"samples": 64 if quick else 256, "batch_size": 32, "epochs": 1 if quick else 2,
                     "repeats": 2 if quick else 7},
    }


def run_timing(name: str, plan: Dict[str, int]) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_") as tmp:
        result = run_group(timing_entry, (name, plan["samples"], plan["batch_size"], plan["epochs"], plan["repeats"]),
                           os.path.join(tmp, f"time_{name}.json"))
    result.update(plan)
    result["steps"] = math.ceil(plan["samples"] / plan["batch_size"])
    result["params"] = count_params(name)
    result["load"] = load_average()
    return result


def timing_row(name: str, case: Dict[str, Any]) -> Dict[str, Any]:
    ratios = [f / d for d, f in zip(case["ddp"], case["fsdp"])]
    d_med, f_med = statistics.median(case["ddp"]), statistics.median(case["fsdp"])
    return {"case": name, "ddp_ms": d_med * 1e3, "fsdp_ms": f_med * 1e3, "ratio": statistics.median(ratios),
            "lo": min(ratios), "hi": max(ratios), "ddp_step_ms": d_med * 1e3 / case["steps"],
            "fsdp_step_ms": f_med * 1e3 / case["steps"]}


# ----------------------------------------------------------------------------- report
def _mib(b: float) -> str:
    return f"{b / MiB:.0f}"


def memory_table(results: Dict[str, Any], markdown: bool = False) -> str:
    mem = results.get("memory")
    if not mem:
        return ""
    header = ["allocator", "strategy", "rank", "baseline RSS", "build peak +", "train peak +", "whole-run peak +",
              "spread over runs", "end +", "end + after malloc_trim (of which files)",
              "params + grads + AdamW state held", "theory"]
    rows = []
    for label, setting in mem["settings"].items():
        rows_by = memory_rows(setting["runs"])
        for strategy in ("ddp", "fsdp"):
            for rank, r in enumerate(rows_by[strategy]["ranks"]):
                rows.append([label, strategy, str(rank), _mib(r["baseline"]), _mib(r["build_inc"]),
                             _mib(r["train_inc"]), _mib(r["peak_inc"]), _mib(r["spread"]), _mib(r["end_inc"]),
                             f"{_mib(r['end_trimmed_inc'])} ({_mib(r['end_file_inc'])})",
                             f"{_mib(r['param_bytes'])} + {_mib(r['grad_bytes'])} + {_mib(r['optim_bytes'])} = "
                             f"{_mib(r['param_bytes'] + r['grad_bytes'] + r['optim_bytes'])}",
                             _mib(mem["theory"][strategy])])
    return _table(header, rows, markdown)


def memory_summary(results: Dict[str, Any], markdown: bool = False) -> str:
    """Per allocator setting: the largest ranks, their ratio and the target; the theory; the
    RSS after each step (rank 0)."""
    mem = results.get("memory")
    if not mem:
        return ""
    theory = mem["theory"]
    bullet = "- " if markdown else ""
    lines = []
    for label, setting in mem["settings"].items():
        rows_by = memory_rows(setting["runs"])
        ddp, fsdp = rows_by["ddp"]["max_peak"], rows_by["fsdp"]["max_peak"]
        lines.append(f"{bullet}{label}: largest rank's peak increase ddp {ddp / MiB:.0f} MiB, fsdp {fsdp / MiB:.0f} "
                     f"MiB: ratio fsdp/ddp {rows_by['ratio']:.3f} (target <= {MEMORY_TARGET}: "
                     f"{'met' if rows_by['meets'] else 'MISSED'}); RSS increase after each step, rank 0: "
                     + "; ".join(f"{s} " + " ".join(_mib(v) for v in rows_by[s]["ranks"][0]["trace"])
                                 for s in ("ddp", "fsdp")) + " MiB")
    lines.append(f"{bullet}theory, 4 B x {mem['params'] / 1e6:.2f} M params x (1 weights + 1 grads + 2 AdamW): "
                 f"ddp {theory['ddp'] / MiB:.0f} MiB, fsdp {theory['fsdp'] / MiB:.0f} MiB (/{WORLD}), "
                 f"ratio {theory['fsdp'] / theory['ddp']:.2f}")
    return "\n".join(lines)


def memory_findings(results: Dict[str, Any]) -> str:
    """Sentences from the figures: RSS growth over the steps and memory held free by glibc."""
    mem = results.get("memory")
    if not mem:
        return ""
    lines = []
    for label, setting in mem["settings"].items():
        rows_by = memory_rows(setting["runs"])
        parts = []
        for strategy in ("ddp", "fsdp"):
            ranks = rows_by[strategy]["ranks"]
            growth = max(r["trace"][-1] - r["trace"][0] for r in ranks) if ranks[0]["trace"] else 0.0
            held = max(r["end_inc"] - r["end_trimmed_inc"] for r in ranks)
            over = max(r["peak_inc"] - r["end_trimmed_inc"] for r in ranks)
            parts.append(f"{strategy}: RSS after the last step {growth / MiB:+.0f} MiB from after the first (largest "
                         f"rank), {held / MiB:.0f} MiB free heap given back by malloc_trim after the run, peak "
                         f"{over / MiB:.0f} MiB above what is live after the run")
        lines.append(f"- {label}: " + "; ".join(parts) + ".")
    return "\n".join(lines)


def timing_table(results: Dict[str, Any], markdown: bool = False) -> str:
    cases = results.get("timing")
    if not cases:
        return ""
    header = ["case", "params", "samples", "global batch", "steps/epoch", "timed pairs", "ddp ms/epoch",
              "fsdp ms/epoch", "ddp ms/step", "fsdp ms/step", "ratio fsdp/ddp (median)", "paired range",
              "max |dparam| after 1 epoch", "load"]
    rows = []
    for name, case in cases.items():
        r = timing_row(name, case)
        params = f"{case['params'] / 1e6:.2f} M" if case["params"] >= 1e5 else f"{case['params']:,}"
        rows.append([name, params, str(case["samples"]), str(case["batch_size"]),
                     str(case["steps"]), str(len(case["ddp"])), f"{r['ddp_ms']:.1f}", f"{r['fsdp_ms']:.1f}",
                     f"{r['ddp_step_ms']:.2f}", f"{r['fsdp_step_ms']:.2f}", f"{r['ratio']:.3f}",
                     f"{r['lo']:.3f}-{r['hi']:.3f}", f"{case['param_diff']:.1e}", f"{case['load']:.1f}"])
    return _table(header, rows, markdown)


def text_report(results: Dict[str, Any]) -> str:
    parts = []
    if results.get("memory"):
        parts.append("Memory per rank, MiB: RSS increase from just before the model is built\n"
                     + memory_table(results) + "\n\n" + memory_summary(results) + "\n" + memory_findings(results))
    if results.get("timing"):
        parts.append("Step time, 2 processes\n" + timing_table(results))
    return "\n\n".join(parts)


def write_markdown(path: str, results: Dict[str, Any]) -> None:
    info = results["machine"]
    mem = results.get("memory")
    text = [f"""# strategy: fsdp against strategy: ddp

Refresh with

    {CANONICAL}

(`--quick` for a short run, `--cases` to pick cases; `bench/bench_fsdp.py --help`). The figures
below come from `{results['command']}`{" (a quick run)" if results.get("quick") else ""}.

## Machine

| | |
|---|---|
| CPU | {info['cpu']} |
| cores | {info['cores']} |
| processes | {WORLD} (gloo, CPU), 1 torch thread each |
| torch / torchvision / Python | {info['torch']} / {info['torchvision']} / {info['python']} |
| library state | {info['library']} |
| date | {info['date']} |
| load average (1 min) at start / end | {info['load_start']:.1f} / {results.get('load_end', float('nan')):.1f} |
| run time of this benchmark | {results.get('total_s', 0.0):.0f} s |
"""]
    if mem:
        runs = next(iter(mem["settings"].values()))["runs"]
        method = next(iter(mem["settings"].values()))["method"]
        text.append(f"""## Memory per process

RSS increase of each process from just before the model is built, MiB (median over runs):

{memory_table(results, markdown=True)}

{memory_summary(results, markdown=True)}

Method: {mem['params'] / 1e6:.1f} M parameters (16 -> 2048, 12 blocks `x + tanh(Linear(2048, 2048)(x))`,
-> 10 classes), AdamW, {mem['steps']} steps of global batch {mem['batch_size']} on random in-memory
data (activations: kilobytes). Every run is a fresh pair of processes started by `launch`
(order ddp, fsdp, fsdp, ddp, ...; {len(runs['ddp'])} run(s) each per allocator setting). In
`build_model`, just before the model is made: `gc.collect()`, {"`malloc_trim(0)`" if mem['trim'] else "no malloc_trim"},
then the peak is reset; peak read with {method}. "build peak +" covers `build_model`, the
optimizer and the rest of `build()` (rank 0 of fsdp builds the whole model before sharding it);
"train peak +" the run (peak reset after `build()`, measured from the same baseline); "end +"
the RSS after the run, and after `gc.collect()` + `malloc_trim(0)` (what stays once glibc gave
its free memory back: the live tensors, plus library code paged in on first use, the
file-backed part in brackets, and allocations of torch, gloo and Python). "params + grads +
AdamW state held" counts this rank's tensors (a DTensor's local shard; gradients taken equal
to the parameters); DDP also keeps its gradient buckets (another copy of the gradients), which
it does not count.

Allocator settings: "glibc default" is what a user gets: no `MALLOC_*` variable set. glibc's
mmap threshold starts at 128 KiB and, by default, rises to the size of each mmapped block that
is freed (up to 32 MiB; mallopt(3), M_MMAP_THRESHOLD), so after the first 16 MiB block is freed,
blocks up to that size come from the heap, where freed memory stays resident until it is reused
or trimmed; FSDP gathers and frees every block's parameters and gradients at each step, so its
RSS grew step after step (1.45x ddp's peak before basetrainer did anything about it). Under
`strategy: fsdp` on the CPU, basetrainer therefore fixes the threshold at 1 MiB in each process
(`mallopt`, in `fsdp_build.shard`, unless `MALLOC_MMAP_THRESHOLD_` is set): such blocks are their
own mappings and go back to the system when freed, so the RSS follows the live tensors; ddp
processes are left as glibc makes them. The "mmap" setting sets `MALLOC_MMAP_THRESHOLD_` in both
strategies' environment (then basetrainer leaves it alone). What this run shows:

{memory_findings(results)}
""")
    if results.get("timing"):
        text.append(f"""## Step time

{timing_table(results, markdown=True)}

Method: epoch time of a run = (end of the last epoch - start of the first) / epochs, in rank 0;
within one process group, timed runs alternate ddp, fsdp, fsdp, ddp, ... after an untimed
1-epoch pair whose final parameters are compared (gathered whole under fsdp); "ratio" is the
median of the paired ratios. Trainer: `EngineTrainer`, AdamW, no callbacks, progress off,
`work_dir: ""`, `num_workers: 0`, in-memory `TensorDataset`. The ratio is a figure, not a target.
""")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(text))


# ----------------------------------------------------------------------------- command line
def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (about a minute)")
    parser.add_argument("--cases", nargs="+", default=None, choices=CASES, metavar="CASE",
                        help=f"cases to run (default all): {', '.join(CASES)}")
    parser.add_argument("--out", default=None, help="folder for fsdp.md (e.g. docs)")
    parser.add_argument("--json", default=None, help="also write the raw figures to this JSON file")
    parser.add_argument("--memory-repeats", type=int, default=None,
                        help="fresh process groups per strategy and allocator setting in the memory case "
                             "(default 2, quick 1)")
    parser.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=ALLOCATORS,
                        help="glibc settings of the memory case (default both): default = glibc as it comes, "
                             "mmap = MALLOC_MMAP_THRESHOLD_ fixed at --mmap-threshold")
    parser.add_argument("--mmap-threshold", type=int, default=65536, metavar="BYTES",
                        help="MALLOC_MMAP_THRESHOLD_ of the 'mmap' setting (default 65536): blocks from this "
                             "size are mmapped and go back to the system when freed")
    parser.add_argument("--no-trim", action="store_true",
                        help="do not call glibc's malloc_trim(0) before the memory baseline")
    return parser


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = get_parser().parse_args(argv)
    cases = [c for c in CASES if c in (args.cases or CASES)]
    torch.set_num_threads(1)
    logging.getLogger("basetrainer").setLevel(logging.ERROR)

    def say(msg: str) -> None:
        print(msg, flush=True)

    t_start = time.perf_counter()
    results: Dict[str, Any] = {"machine": machine_info(1), "quick": args.quick, "timing": {}}
    say(f"bench_fsdp: {', '.join(cases)} on {results['machine']['cpu']} ({results['machine']['cores']} cores), "
        f"torch {results['machine']['torch']}, {WORLD} gloo processes x 1 thread, "
        f"load {results['machine']['load_start']:.1f}")
    plan = timing_plan(args.quick)
    for name in cases:
        t0 = time.perf_counter()
        say(f"[{name}]")
        if name == "memory":
            repeats = args.memory_repeats or (1 if args.quick else 2)
            results["memory"] = run_memory(args.quick, repeats, not args.no_trim, args.allocators,
                                           args.mmap_threshold, say)
        else:
            results["timing"][name] = run_timing(name, plan[name])
        say(f"    ({time.perf_counter() - t0:.0f} s)")
    results["total_s"] = time.perf_counter() - t_start
    results["load_end"] = load_average()
    shown = [a for i, a in enumerate(argv) if a != "--json" and (i == 0 or argv[i - 1] != "--json")]
    results["command"] = (".venv/bin/python bench/bench_fsdp.py " + " ".join(shown)).strip()
    say("")
    say(text_report(results))
    say(f"\ntotal {results['total_s']:.0f} s; load average {results['machine']['load_start']:.1f} at start, "
        f"{results['load_end']:.1f} at end")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "fsdp.md")
        write_markdown(path, results)
        say(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
