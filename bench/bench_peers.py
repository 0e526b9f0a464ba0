"""Peers side by side: the same runs trained by a hand-written PyTorch loop, basetrainer (this
repository), PyTorch Lightning, Lightning Fabric, Accelerate and the original basetrainer 1.0.4,
each with its default settings, in CPU time and wall time per step.

    bash bench/peers_env.sh                               # once: bench/.venv-peers (~300 MB)
    .venv/bin/python bench/bench_peers.py --out docs      # docs/peers.json + docs/benchmarks.md's peers table
    .venv/bin/python bench/bench_peers.py --rounds 1      # a short check

The default 5 rounds take about 15-20 minutes on the 2-core machine (60 fresh processes; a
resnet18 step costs about a second of CPU there).

The peers run in bench/.venv-peers (made by bench/peers_env.sh: Lightning, Accelerate and
basetrainer 1.0.4 with the packages it imports without declaring them; it shares .venv's torch
through a .pth line, so torch stays the one tested here). basetrainer 1.0.4 has this package's
import name: its runs start in a folder outside the repository, so ``import basetrainer`` finds
1.0.4 there.

Every run is a fresh process that trains one contender for ``EPOCHS`` epochs on in-memory
tensors (``tiny``: the tiny CNN on 3x8x8, 6400 samples, batch 64; ``resnet18``: a CIFAR-style
torchvision resnet18 on 3x32x32, 128 samples, batch 32), one torch thread, SGD (lr 0.05,
momentum 0.9, weight decay 5e-4), cross-entropy, the same initial weights; the first epoch is a
warm-up, the others are timed (epoch-start hook to epoch-end hook: CPU time of the process over
all its threads, and wall time). A round runs every contender once per case, the order turning
each round; a contender's ratio is paired with the hand loop's run of the same round.

Default settings of each (what a user gets from the quickstart, nothing turned off):

- hand: ``DataLoader(shuffle=True)``, forward, backward, step, ``zero_grad``.
- basetrainer: an ``EngineTrainer`` with ``self.build_dataloader(...)`` (per-sample seeding on),
  the config's defaults (progress bar on), no callbacks.
- Lightning: ``L.Trainer(max_epochs=...)`` on the CPU: progress bar, model summary, TensorBoard
  or CSV logger every 50 steps and a checkpoint every epoch (its defaults), in a temp folder.
- Fabric: ``L.Fabric(accelerator="cpu", devices=1)``, ``setup``, ``setup_dataloaders``,
  ``fabric.backward``.
- Accelerate: ``Accelerator(cpu=True)``, ``prepare``, ``accelerator.backward``.
- basetrainer 1.0.4: its ``EngineTrainer`` with its ``build_dataloader`` (``distributed=False``),
  progress bar on, no callbacks.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS_PYTHON = os.path.join(HERE, ".venv-peers", "bin", "python")
CONTENDERS = ("hand", "basetrainer", "lightning", "fabric", "accelerate", "basetrainer-1.0.4")
IN_PEERS_VENV = ("lightning", "fabric", "accelerate", "basetrainer-1.0.4")
CASES = {"tiny": {"samples": 6400, "batch": 64, "shape": (3, 8, 8)},
         "resnet18": {"samples": 128, "batch": 32, "shape": (3, 32, 32)}}
EPOCHS = {"tiny": 4, "resnet18": 3}
SEED = 2020


# ------------------------------------------------------------------ one run (a fresh process)
def _model(case: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    if case == "tiny":
        class TinyCNN(nn.Module):   # bench/loop_contenders.py's
            def __init__(self) -> None:
                super().__init__()
                self.features = nn.Sequential(
                    nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True),
                    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
                self.head = nn.Linear(32 * 4 * 4, 10)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(torch.flatten(self.features(x), 1))
        return TinyCNN()
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)   # 32x32 inputs: no stride-2 stem, no max-pool
    model.maxpool = nn.Identity()
    return model


def _data(case: str) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    spec = CASES[case]
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(spec["samples"], *spec["shape"], generator=g)
    w = torch.randn(x[0].numel(), 10, generator=g)
    return TensorDataset(x, (x.flatten(1) @ w).argmax(dim=1))


class _Clock:
    """Epoch starts and ends, (wall, CPU) seconds."""

    def __init__(self) -> None:
        self.starts: List[tuple] = []
        self.ends: List[tuple] = []

    @staticmethod
    def now() -> tuple:
        return time.perf_counter(), time.process_time()

    def start(self) -> None:
        self.starts.append(self.now())

    def end(self) -> None:
        self.ends.append(self.now())

    def per_epoch(self) -> Dict[str, float]:
        """The timed epochs (all but the first): wall and CPU seconds per epoch."""
        (w0, c0), (w1, c1), n = self.starts[1], self.ends[-1], len(self.ends) - 1
        return {"wall_s": (w1 - w0) / n, "cpu_s": (c1 - c0) / n}


def _sgd(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)


def run_hand(case: str, epochs: int, clock: _Clock) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    model, criterion = _model(case), nn.CrossEntropyLoss()
    optimizer = _sgd(model.parameters())
    loader = DataLoader(_data(case), batch_size=CASES[case]["batch"], shuffle=True,
                        generator=torch.Generator().manual_seed(SEED))
    for _ in range(epochs):
        clock.start()
        model.train()
        for x, y in loader:
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        clock.end()


def run_basetrainer(case: str, epochs: int, clock: _Clock) -> None:
    from torch import nn

    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.engine import trainer

    class Clocked(Callback):
        def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
            clock.start()

        def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
            clock.end()

    class Trainer(trainer.EngineTrainer):
        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            self.build(self.cfg)

        def build_train_loader(self, cfg: Any, **kwargs: Any) -> Any:
            return self.build_dataloader(_data(case), cfg.batch_size, cfg.num_workers, phase="train")

        def build_test_loader(self, cfg: Any, **kwargs: Any) -> None:
            return None

        def build_model(self, cfg: Any, **kwargs: Any) -> Any:
            return self.build_model_parallel(_model(case), cfg.gpu_id, distributed=cfg.distributed)

        def build_criterion(self, cfg: Any, **kwargs: Any) -> Any:
            return nn.CrossEntropyLoss()

        def build_optimizer(self, cfg: Any, **kwargs: Any) -> Any:
            return _sgd(self.model.parameters())

        def build_callbacks(self, cfg: Any, **kwargs: Any) -> List[Any]:
            return [Clocked()]

    with tempfile.TemporaryDirectory() as work_dir:
        Trainer({"batch_size": CASES[case]["batch"], "num_epochs": epochs, "gpu_id": [], "work_dir": work_dir,
                 "seed": SEED}).run()


def run_lightning(case: str, epochs: int, clock: _Clock) -> None:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.criterion = _model(case), nn.CrossEntropyLoss()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return self.criterion(self.model(x), y)

        def configure_optimizers(self) -> Any:
            return _sgd(self.parameters())

    class Clocked(L.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            clock.start()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            clock.end()

    with tempfile.TemporaryDirectory() as work_dir:
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, default_root_dir=work_dir,
                            callbacks=[Clocked()])
        trainer.fit(Module(), DataLoader(_data(case), batch_size=CASES[case]["batch"], shuffle=True))


def run_fabric(case: str, epochs: int, clock: _Clock) -> None:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader

    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    model = _model(case)
    model, optimizer = fabric.setup(model, _sgd(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(_data(case), batch_size=CASES[case]["batch"], shuffle=True))
    criterion = nn.CrossEntropyLoss()
    for _ in range(epochs):
        clock.start()
        model.train()
        for x, y in loader:
            loss = criterion(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        clock.end()


def run_accelerate(case: str, epochs: int, clock: _Clock) -> None:
    from accelerate import Accelerator
    from torch import nn
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)
    model = _model(case)
    model, optimizer, loader = accelerator.prepare(
        model, _sgd(model.parameters()), DataLoader(_data(case), batch_size=CASES[case]["batch"], shuffle=True))
    criterion = nn.CrossEntropyLoss()
    for _ in range(epochs):
        clock.start()
        model.train()
        for x, y in loader:
            loss = criterion(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        clock.end()


def run_basetrainer_104(case: str, epochs: int, clock: _Clock) -> None:
    from easydict import EasyDict
    from torch import nn

    import basetrainer
    from basetrainer.engine import trainer

    if os.path.dirname(os.path.dirname(os.path.abspath(basetrainer.__file__))) == ROOT:
        raise SystemExit("basetrainer-1.0.4: this repository's basetrainer was imported; run from outside it")

    class Trainer(trainer.EngineTrainer):
        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            self.build(cfg)

        def build_train_loader(self, cfg: Any, **kwargs: Any) -> Any:
            return self.build_dataloader(_data(case), cfg.batch_size, 0, phase="train", distributed=False)

        def build_test_loader(self, cfg: Any, **kwargs: Any) -> None:
            return None

        def build_model(self, cfg: Any, **kwargs: Any) -> Any:
            return _model(case).to(self.device)

        def build_criterion(self, cfg: Any, **kwargs: Any) -> Any:
            return nn.CrossEntropyLoss()

        def build_optimizer(self, cfg: Any, **kwargs: Any) -> Any:
            return _sgd(self.model.parameters())

        def build_callbacks(self, cfg: Any, **kwargs: Any) -> List[Any]:
            return []

        def on_epoch_begin(self, epoch: int, logs: dict = {}) -> None:  # noqa: B006 (1.0.4's signature)
            clock.start()
            super().on_epoch_begin(epoch, logs)

        def on_epoch_end(self, epoch: int, logs: dict = {}) -> None:  # noqa: B006
            super().on_epoch_end(epoch, logs)
            clock.end()

    Trainer(EasyDict({"batch_size": CASES[case]["batch"], "num_epochs": epochs, "gpu_id": [0], "progress": True,
                      "distributed": False})).run()


RUNS: Dict[str, Callable[[str, int, _Clock], None]] = {
    "hand": run_hand, "basetrainer": run_basetrainer, "lightning": run_lightning, "fabric": run_fabric,
    "accelerate": run_accelerate, "basetrainer-1.0.4": run_basetrainer_104}


def one_run(contender: str, case: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    clock = _Clock()
    RUNS[contender](case, EPOCHS[case], clock)
    versions = {"torch": torch.__version__}
    for name in ("lightning", "accelerate"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    with open(out, "w", encoding="utf-8") as f:
        json.dump({**clock.per_epoch(), "versions": versions}, f)


# ------------------------------------------------------------------ the driver
def _interpreter(contender: str) -> tuple:
    """(python, cwd, extra env) of a contender's process."""
    if contender in IN_PEERS_VENV:
        return PEERS_PYTHON, tempfile.gettempdir(), {}
    return sys.executable, ROOT, {"PYTHONPATH": ROOT}


def run_one(contender: str, case: str) -> Dict[str, Any]:
    python, cwd, env = _interpreter(contender)
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        out = os.path.join(tmp, "run.json")
        done = subprocess.run([python, os.path.abspath(__file__), "--one", contender, "--case", case, "--json", out],
                              cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not os.path.isfile(out):
            raise SystemExit(f"bench_peers: {contender} on {case} failed (exit {done.returncode}):\n"
                             f"{done.stderr[-3000:]}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def summarise(runs: Dict[str, Dict[str, List[Dict[str, Any]]]]) -> Dict[str, Any]:
    """Per case and contender: median CPU and wall us/step, and the ratio to the hand loop's run
    of the same round (median, bootstrap 95% interval)."""
    sys.path.insert(0, HERE)
    import loop_stats

    out: Dict[str, Any] = {}
    for case, by in runs.items():
        steps = -(-CASES[case]["samples"] // CASES[case]["batch"])
        hand = by["hand"]
        out[case] = {}
        for contender, rs in by.items():
            ratios = [r["cpu_s"] / h["cpu_s"] for r, h in zip(rs, hand)]
            wall_ratios = [r["wall_s"] / h["wall_s"] for r, h in zip(rs, hand)]
            ratio, lo, hi = loop_stats.bootstrap_median(ratios)
            out[case][contender] = {
                "cpu_us": statistics.median(r["cpu_s"] for r in rs) / steps * 1e6,
                "wall_us": statistics.median(r["wall_s"] for r in rs) / steps * 1e6,
                "cpu_ratio": ratio, "cpu_ratio_lo": lo, "cpu_ratio_hi": hi,
                "wall_ratio": statistics.median(wall_ratios), "wall_min": min(wall_ratios),
                "wall_max": max(wall_ratios), "rounds": len(rs), "steps": steps}
    return out


def table(summary: Dict[str, Any], markdown: bool = True) -> str:
    """One row per case and contender."""
    header = ["case", "contender", "CPU us/step", "CPU ratio to hand [95%]", "wall us/step", "wall ratio (range)",
              "rounds"]
    rows = []
    for case, by in summary.items():
        for contender, v in by.items():
            rows.append([case, contender, f"{v['cpu_us']:.0f}",
                         f"{v['cpu_ratio']:.3f} [{v['cpu_ratio_lo']:.3f}, {v['cpu_ratio_hi']:.3f}]",
                         f"{v['wall_us']:.0f}", f"{v['wall_ratio']:.3f} ({v['wall_min']:.3f}-{v['wall_max']:.3f})",
                         str(v["rounds"])])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in rows])


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--rounds", type=int, default=5, help="rounds (every contender once per case each)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--out", default=None, help="folder for peers.json (e.g. docs); docs/benchmarks.md's "
                                                    "peers table is rewritten from it")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        one_run(args.one, args.case, args.json)
        return {}
    contenders = ["hand"] + [c for c in args.contenders if c != "hand"]
    if any(c in IN_PEERS_VENV for c in contenders) and not os.path.isfile(PEERS_PYTHON):
        raise SystemExit(f"bench_peers: {PEERS_PYTHON} is missing: make it with `bash bench/peers_env.sh`, "
                         f"or give --contenders hand basetrainer")
    t0 = time.perf_counter()
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {c: {k: [] for k in contenders} for c in args.cases}
    versions: Dict[str, str] = {}
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for case in args.cases:
            for contender in order:
                result = run_one(contender, case)
                versions.update(result.pop("versions"))
                runs[case][contender].append(result)
                print(f"  round {r + 1}/{args.rounds} {case} {contender}: {result['cpu_s'] * 1e3:.1f} ms CPU/epoch, "
                      f"{result['wall_s'] * 1e3:.1f} ms wall/epoch", flush=True)
    sys.path.insert(0, HERE)
    import loop_report

    info = loop_report.machine_info(1)
    summary = {"machine": info, "versions": versions, "python": platform.python_version(),
               "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds,
               "epochs": EPOCHS, "cases": CASES, "total_s": time.perf_counter() - t0, "summary": summarise(runs),
               "runs": runs, "command": ".venv/bin/python bench/bench_peers.py " + " ".join(argv or sys.argv[1:])}
    print("\n" + table(summary["summary"], markdown=False))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "peers.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        import loop_docs

        md = os.path.join(args.out, "benchmarks.md")
        if os.path.isfile(md):
            loop_docs.replace_peers_section(md, summary)
            print(f"wrote {os.path.join(args.out, 'peers.json')} and the peers table of {md}")
    return summary


if __name__ == "__main__":
    main()
