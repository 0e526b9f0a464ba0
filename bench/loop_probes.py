"""Side probes of ``bench_loop.py``: import cost, the example's data pipeline, callback costs.

- :func:`import_times`: the time ``import basetrainer`` (and the trainer and callback modules)
  adds to ``import torch, torchvision``, in fresh interpreters.
- :func:`loader_throughput`: images/s of one pass of examples/example.py's training loader
  (its transforms on the digits ImageFolder) with 0 and 2 worker processes.
- :func:`seeding_cost`: what per-sample seeding costs the default loader with 0 workers, per
  item and per batch, in CPU time.
- :func:`callback_costs`: the wall time each callback spends in each event during a run.
- :func:`write_interference`: what writing resnet18's epoch-end checkpoint files costs the
  training that goes on meanwhile, with the writer in a thread (as ModelCheckpoint does) and in
  another process (no shared interpreter lock).
"""
import collections
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE_IMPORT = "import torch, torchvision"
IMPORT_VARIANTS: Dict[str, str] = {
    "import basetrainer": "import basetrainer",
    "from basetrainer.engine import trainer": "from basetrainer.engine import trainer",
    "callback modules": ("from basetrainer.callbacks import log_history, losses_recorder, model_checkpoint; "
                         "from basetrainer.metric import accuracy_recorder; "
                         "from basetrainer.scheduler import build_scheduler"),
}
_TIMED = ("{base}; import time, sys; t = time.perf_counter(); {extra}; "
          "sys.stdout.write(repr(time.perf_counter() - t))")


def _run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (in the repository root); return its stdout."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout


def _timed_run(code: str) -> Tuple[float, str]:
    """Wall time of a fresh interpreter running ``code``, and its stdout."""
    t0 = time.perf_counter()
    out = _run_python(code)
    return time.perf_counter() - t0, out


def import_times(repeats: int, say: Callable[[str], None] = lambda _m: None) -> Dict[str, Dict[str, float]]:
    """Extra import time of each variant over ``import torch, torchvision``.

    Each round starts one fresh interpreter for the baseline and one per variant, in turn. Two
    figures per variant: ``wall_s``, the median over rounds of (the variant's process wall time
    - the same round's baseline process wall time), and ``inproc_s``, the median time of the
    variant's import statement alone, timed inside its interpreter after torch and torchvision
    are imported (immune to the start-up noise of a busy machine).

    Returns:
        ``{variant: {"wall_s", "wall_lo_s", "wall_hi_s", "inproc_s"}}`` (lo/hi: the range of the
        per-round differences) plus ``{"baseline": {"wall_s": ...}}``.
    """
    walls: Dict[str, List[float]] = collections.defaultdict(list)
    inproc: Dict[str, List[float]] = collections.defaultdict(list)
    _run_python(BASE_IMPORT)  # the page cache holds torch from now on, for every variant alike
    for r in range(repeats):
        base, _ = _timed_run(BASE_IMPORT)
        walls["baseline"].append(base)
        for name, extra in IMPORT_VARIANTS.items():
            wall, out = _timed_run(_TIMED.format(base=BASE_IMPORT, extra=extra))
            walls[name].append(wall - base)
            inproc[name].append(float(out))
        say(f"    round {r + 1}/{repeats}: torch+torchvision {base:.3f} s; "
            + ", ".join(f"{n} +{inproc[n][-1] * 1e3:.1f} ms" for n in IMPORT_VARIANTS))
    out = {"baseline": {"wall_s": statistics.median(walls["baseline"])}}
    for name in IMPORT_VARIANTS:
        out[name] = {"wall_s": statistics.median(walls[name]), "wall_lo_s": min(walls[name]),
                     "wall_hi_s": max(walls[name]), "inproc_s": statistics.median(inproc[name])}
    return out


def example_dataset(input_size: List[int]) -> Any:
    """The digits train ImageFolder with examples/example.py's training transforms."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import example  # noqa: E402  (examples/ is not a package)
    from prepare_data import DEFAULT_ROOT, prepare_digits  # noqa: E402
    from basetrainer.dataloader.image_folder import image_folder
    from basetrainer.utils.setup_config import Config

    root = prepare_digits(DEFAULT_ROOT)
    cfg = Config(input_size=list(input_size))
    maker = object.__new__(example.ClassificationTrainer)  # only its transforms() method is used
    return image_folder(os.path.join(root, "train"), transform=maker.transforms(cfg, train=True))


def loader_throughput(workers: List[int], repeats: int, batch_size: int = 32, input_size: Optional[List[int]] = None,
                      say: Callable[[str], None] = lambda _m: None) -> Dict[str, Dict[str, float]]:
    """Images/s of the example's train loader (built as its build_train_loader builds it), with
    the per-sample seeding of random draws (the default) and without it.

    For each worker count and seeding, alternately, a fresh loader makes two passes: the first
    includes starting the workers, the second reuses them (persistent workers).

    Returns:
        ``{"<num_workers>" or "<num_workers>-unseeded": {"first": images/s, "second": images/s,
        "images": n}}`` (medians).
    """
    from basetrainer.dataloader.loader import build_dataloader

    dataset = example_dataset(input_size or [32, 32])
    variants = [(w, seeded) for w in workers for seeded in (True, False)]
    rates: Dict[str, Dict[str, List[float]]] = {}
    count = 0
    for r in range(repeats):
        for w, seeded in (variants if r % 2 == 0 else variants[::-1]):   # neither always goes first
            name = f"{w}" if seeded else f"{w}-unseeded"
            loader = build_dataloader(dataset, batch_size, w, phase="train", shuffle=True, drop_last=True,
                                      seed_per_sample=seeded)
            for which in ("first", "second"):
                loader.batch_sampler.set_epoch(r)
                t0 = time.perf_counter()
                count = sum(int(x.shape[0]) for x, _ in loader)
                rates.setdefault(name, {"first": [], "second": []})[which].append(count / (time.perf_counter() - t0))
            del loader
            say(f"    round {r + 1}/{repeats}: num_workers={name}: {rates[name]['first'][-1]:.0f} images/s "
                f"(first pass), {rates[name]['second'][-1]:.0f} images/s (second)")
    return {name: {"first": statistics.median(v["first"]), "second": statistics.median(v["second"]),
                   "images": count} for name, v in rates.items()}


SEEDING_BATCHES = (8, 16, 32, 64, 128)


class _RandomFlip:
    """A data set's items, each flipped left-right with probability 0.5 (drawn from torch)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        import torch

        x, y = self.dataset[i]
        return (x.flip(-1) if float(torch.rand(())) < 0.5 else x), y


def seeding_cost(repeats: int, say: Callable[[str], None] = lambda _m: None) -> Dict[str, Any]:
    """CPU time of per-sample seeding in the default loader (0 workers): per item and per batch.

    For each data set (an in-memory TensorDataset of 3x8x8 tensors, which draws nothing, and
    the same with a random horizontal flip drawn from torch's generator, as torchvision's
    transforms draw; an image pipeline's own cost per item, hundreds of microseconds, would
    hide the seeding's in its noise) and
    each batch size in :data:`SEEDING_BATCHES`, a pass over ``build_dataloader(...)`` (the
    default) and over the same loader with ``seed_per_sample=False`` alternate, ``repeats``
    times; the CPU time of this thread per batch is read around each pass (one torch thread).
    The median extra time per batch is fitted by least squares as ``a * batch_size + b``:
    ``a`` is the cost per item, ``b`` the cost per batch.

    Returns:
        ``{data set: {"per_item_us", "per_batch_us", "extra_us": {batch size: median extra us
        per batch}}}``.
    """
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    from basetrainer.dataloader.loader import build_dataloader

    g = torch.Generator().manual_seed(0)
    tensors = TensorDataset(torch.randn(4096, 3, 8, 8, generator=g), torch.randint(0, 10, (4096,), generator=g))
    sets = {"in-memory tensors, no random draws": tensors,
            "in-memory tensors, a random flip (torch)": _RandomFlip(tensors)}
    out: Dict[str, Any] = {}
    for name, data in sets.items():
        loaders = {(b, seeded): build_dataloader(data, b, 0, phase="train", seed_per_sample=seeded)
                   for b in SEEDING_BATCHES for seeded in (True, False)}
        extra: Dict[int, List[float]] = {b: [] for b in SEEDING_BATCHES}
        for r in range(repeats):
            for b in SEEDING_BATCHES:
                per = {}
                for seeded in ((True, False) if r % 2 else (False, True)):
                    loader = loaders[(b, seeded)]
                    t0 = time.thread_time()
                    for _ in loader:
                        pass
                    per[seeded] = (time.thread_time() - t0) / len(loader)
                extra[b].append((per[True] - per[False]) * 1e6)
        medians = {b: statistics.median(v) for b, v in extra.items()}
        a, b0 = np.polyfit(list(medians), list(medians.values()), 1)
        out[name] = {"per_item_us": float(a), "per_batch_us": float(b0), "extra_us": medians}
        say(f"    {name}: {a:.2f} us per item + {b0:.1f} us per batch (CPU time; extra per batch: "
            + ", ".join(f"{k}: {v:.1f}" for k, v in medians.items()) + ")")
    return out


def callback_costs(run: Callable[[Callable[[Any], None]], Any]) -> Tuple[Dict[str, Dict[str, float]], Any]:
    """Time each callback's handlers during one run.

    Args:
        run: builds a trainer, applies the patch it is given to it, runs it and returns what
            it likes (see :func:`loop_contenders.run_basetrainer`'s ``patch``).

    Returns:
        ``({"<Callback>.<event>": {"total_s": ..., "calls": ...}}, run's result)``, largest
        first (the timing wrappers add about a microsecond per call).
    """
    totals: Dict[str, float] = collections.Counter()
    calls: Dict[str, int] = collections.Counter()

    def timed(key: str, handler: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return handler(*args)
            finally:
                totals[key] += time.perf_counter() - t0
                calls[key] += 1
        return wrapper

    from basetrainer.engine import engine as engine_module

    plain = engine_module.CallbackList

    class TimedCallbackList(plain):  # the engine builds one per run: wrap its handlers
        def __init__(self, callbacks: Any, trainer: Any) -> None:
            super().__init__(callbacks, trainer)
            for event, handlers in self.handlers.items():
                self.handlers[event] = [(name, timed(f"{name}.{event}", h)) for name, h in handlers]

    def patch(bt: Any) -> None:
        engine_module.CallbackList = TimedCallbackList

    try:
        outcome = run(patch)
    finally:
        engine_module.CallbackList = plain
    return {k: {"total_s": totals[k], "calls": calls[k]} for k in sorted(totals, key=lambda k: -totals[k])}, outcome


WRITE_PROBE_STEPS = 2   # resnet18 steps timed per way (about 0.45 s: longer than the writes)


def _resnet18_training() -> Tuple[Any, Callable[..., float]]:
    """resnet18_on's model and SGD optimizer after one step (momentum buffers exist, as at any
    epoch end), and a function that times ``WRITE_PROBE_STEPS`` more training steps."""
    import torch

    import loop_contenders as lc

    torch.manual_seed(lc.SEED)
    model = lc.resnet18_32()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=lc.MOMENTUM, weight_decay=lc.WEIGHT_DECAY)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, lc.NUM_CLASSES, (32,))
    criterion = torch.nn.CrossEntropyLoss()

    def steps(n: int = WRITE_PROBE_STEPS) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            criterion(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    steps(1)
    return (model, optimizer), steps


def _write_epoch_files(state: Dict[str, Any], folder: str) -> None:
    """The files of one resnet18_on epoch end: the epoch's weights, then last.pth."""
    from basetrainer.runtime import atomic

    atomic.write_atomically(state["model"], os.path.join(folder, "model_000.pth"))
    atomic.write_atomically(state, os.path.join(folder, "last.pth"))


def _writer_process(conn: Any, folder: str) -> None:
    """A separate writer: builds the same state itself, then writes it each time it is asked."""
    import torch

    torch.set_num_threads(1)
    (model, optimizer), _ = _resnet18_training()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    conn.send("ready")
    while conn.recv():
        _write_epoch_files(state, folder)
        conn.send("done")


def write_interference(repeats: int, say: Callable[[str], None] = lambda _m: None) -> Dict[str, Any]:
    """What writing resnet18_on's epoch-end files costs the resnet18 training that goes on.

    The files are those of one epoch end of the ``resnet18_on`` case: the epoch's weights file
    and ``last.pth`` (weights and SGD momentum), each written with ``atomic.write_atomically``
    (temp file, fsync, rename), from a snapshot taken in the training thread
    (``atomic.snapshot``, as the trainer's background checkpoint does). Each repeat times
    ``WRITE_PROBE_STEPS`` resnet18 training steps (batch 32 at 32x32, one torch thread) three
    ways, the order turning by one each repeat: alone; while the library's background writer
    thread writes the files; while a separate process (started once, holding its own copy of
    the state; no interpreter lock shared) writes them. *Lost*: how much longer the steps took
    than the same repeat's steps alone. One untimed round comes first: the first write of a
    process slowed the training by about 250 ms, once per run, not per epoch.

    Returns:
        ``{"mb": size of the files, "copy_s": median snapshot time, "write_s": median time the
        writer thread took, "alone_s": median time of the steps alone, "lost_thread_s",
        "lost_process_s": median lost time, "lost_thread_each_s", "lost_process_each_s": each
        repeat's lost time, "steps", "repeats"}``.
    """
    from basetrainer.runtime import atomic

    (model, optimizer), steps = _resnet18_training()

    def snapshot() -> Dict[str, Any]:   # what the trainer copies at an epoch end
        return atomic.snapshot({"model": model.state_dict(), "optimizer": optimizer.state_dict()})

    folder = tempfile.mkdtemp(prefix="bench_writes_")
    conn, child_conn = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_writer_process, args=(child_conn, folder))
    child.start()
    figures: Dict[str, List[float]] = collections.defaultdict(list)
    ways = ("alone", "thread", "process")
    try:
        if not conn.poll(120) or conn.recv() != "ready":
            raise RuntimeError("the probe's writer process did not start within 120 s")
        for r in range(-1, repeats):    # r = -1: untimed, the first write of a process is slower
            for way in ways[r % 3:] + ways[:r % 3]:
                if way == "alone":
                    t0 = time.perf_counter()
                    snapshot()
                    figures["copy"].append(time.perf_counter() - t0)
                    figures["alone"].append(steps())
                elif way == "thread":
                    state = snapshot()
                    wrote: Dict[str, float] = {}

                    def job(state: Dict[str, Any] = state) -> None:
                        t = time.perf_counter()
                        _write_epoch_files(state, folder)
                        wrote["s"] = time.perf_counter() - t

                    atomic.write_in_background(job, "the write probe's files")
                    del state
                    figures["thread"].append(steps())
                    atomic.wait_for_writes()
                    figures["write"].append(wrote["s"])
                else:
                    conn.send(True)
                    figures["process"].append(steps())
                    if not conn.poll(120) or conn.recv() != "done":
                        raise RuntimeError("the probe's writer process did not finish a write within 120 s")
        mb = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2 ** 20
    finally:
        if child.is_alive():
            try:
                conn.send(False)
            except OSError:
                pass
            child.join(30)
            if child.is_alive():
                child.kill()
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    figures = {k: v[1:] for k, v in figures.items()}   # without the untimed first round
    alone = figures["alone"]
    lost = {way: [t - a for t, a in zip(figures[way], alone)] for way in ("thread", "process")}
    out = {"mb": mb, "steps": WRITE_PROBE_STEPS, "repeats": repeats,
           "copy_s": statistics.median(figures["copy"]), "write_s": statistics.median(figures["write"]),
           "alone_s": statistics.median(alone),
           "lost_thread_s": statistics.median(lost["thread"]), "lost_process_s": statistics.median(lost["process"]),
           "lost_thread_each_s": lost["thread"], "lost_process_each_s": lost["process"]}
    say(f"    {mb:.0f} MB per epoch end: copy {out['copy_s'] * 1e3:.1f} ms; {WRITE_PROBE_STEPS} resnet18 steps "
        f"{out['alone_s'] * 1e3:.0f} ms alone, {out['lost_thread_s'] * 1e3:+.1f} ms with the writer thread "
        f"(writing for {out['write_s'] * 1e3:.0f} ms), {out['lost_process_s'] * 1e3:+.1f} ms with a writer process")
    return out
