"""Tabular regression with basetrainer: scikit-learn's bundled diabetes data (no download).

442 patients, 10 features, a disease-progression target. A fixed 80/20 split (``split_seed``),
features standardised with the train part's mean and deviation only, an MLP trained with MSE,
and MAE and R² through MetricRecorder (torchmetrics, exact over DDP ranks); ModelCheckpoint
keeps the epoch of the lowest test MAE. At the end it prints the final figures beside a linear
regression (scikit-learn's LinearRegression, fitted on the same split) as the baseline.

    python examples/regression.py                      # one process
    python examples/regression.py --distributed        # DDP, 2 processes (gloo on the CPU)
"""
import argparse
import os
import time
from typing import Any, Dict

import torch
from torch import nn
from torch.utils.data import TensorDataset

import basetrainer
from basetrainer.callbacks import log_history, losses_recorder, model_checkpoint
from basetrainer.engine import trainer
from basetrainer.engine.launch import launch
from basetrainer.optimizer.build_optimizer import get_optimizer
from basetrainer.runtime import errors
from basetrainer.scheduler import build_scheduler
from basetrainer.utils import file_utils, log, setup_config


def load_split(split_seed: int, test_size: float = 0.2) -> Dict[str, Any]:
    """The diabetes data, split and standardised (the scaler fitted on the train part only).

    Returns:
        ``{"x_train", "y_train", "x_test", "y_test"}`` as float32 tensors, plus ``"linear_r2"``
        and ``"linear_mae"``: the test figures of a least-squares linear regression on the same
        split (the baseline).
    """
    from sklearn.datasets import load_diabetes
    from sklearn.linear_model import LinearRegression
    from sklearn.metrics import mean_absolute_error, r2_score
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_diabetes(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_size, random_state=split_seed)
    scaler = StandardScaler().fit(x_train)
    x_train, x_test = scaler.transform(x_train), scaler.transform(x_test)
    linear = LinearRegression().fit(x_train, y_train).predict(x_test)
    as_tensor = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return {"x_train": as_tensor(x_train), "y_train": as_tensor(y_train), "x_test": as_tensor(x_test),
            "y_test": as_tensor(y_test), "linear_r2": float(r2_score(y_test, linear)),
            "linear_mae": float(mean_absolute_error(y_test, linear))}


_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "silu": nn.SiLU}


class MLPRegressor(nn.Module):
    """An MLP whose output is in the target's units: the last layer predicts the standardised
    target, scaled back by the train targets' mean and deviation (buffers, saved with the weights)."""

    def __init__(self, in_features: int, hidden: int, depth: int, y_mean: float, y_std: float,
                 activation: str = "tanh") -> None:
        super().__init__()
        layers, width = [], in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), _ACTIVATIONS[activation]()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)
        self.register_buffer("y_mean", torch.tensor(float(y_mean)))
        self.register_buffer("y_std", torch.tensor(float(y_std)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1) * self.y_std + self.y_mean


class RegressionTrainer(trainer.EngineTrainer):
    """Tabular regression: (features, target) batches, the engine's own run_step, MSE loss."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        cfg.model_root = os.path.join(cfg.work_dir, "model")
        cfg.log_root = os.path.join(cfg.work_dir, "log")
        if self.is_main_process:
            file_utils.create_dir(cfg.model_root)
            file_utils.create_dir(cfg.log_root)
            setup_config.save_config(cfg, os.path.join(cfg.work_dir, "setup_config.yaml"))
        self.logger = log.set_logger(level="info", logfile=os.path.join(cfg.log_root, "train.log"),
                                     is_main_process=self.is_main_process)
        self.data = load_split(cfg.split_seed)
        self.build(cfg)
        self.logger.info("work_dir: %s | device: %s | processes: %d | train samples: %d | test samples: %d | "
                         "linear regression baseline: R2 %.4f, MAE %.2f", cfg.work_dir, self.device, self.world_size,
                         self.num_samples, len(self.data["y_test"]), self.data["linear_r2"], self.data["linear_mae"])

    def build_train_loader(self, cfg: Any, **kwargs: Any) -> Any:
        dataset = TensorDataset(self.data["x_train"], self.data["y_train"])
        return self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="train", shuffle=True,
                                     drop_last=False, distributed=cfg.distributed, seed_per_sample=False)

    def build_test_loader(self, cfg: Any, **kwargs: Any) -> Any:
        dataset = TensorDataset(self.data["x_test"], self.data["y_test"])
        return self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="test", shuffle=False,
                                     distributed=cfg.distributed)

    def build_model(self, cfg: Any, **kwargs: Any) -> nn.Module:
        y = self.data["y_train"]
        model = MLPRegressor(self.data["x_train"].shape[1], cfg.hidden, cfg.depth, float(y.mean()), float(y.std()),
                             cfg.activation)
        return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)

    def build_criterion(self, cfg: Any, **kwargs: Any) -> nn.Module:
        return nn.MSELoss()

    def build_optimizer(self, cfg: Any, **kwargs: Any) -> torch.optim.Optimizer:
        return get_optimizer(self.model, optim_type=cfg.optim_type, lr=cfg.lr, momentum=cfg.momentum,
                             weight_decay=cfg.weight_decay)

    def build_callbacks(self, cfg: Any, **kwargs: Any) -> list:
        from torchmetrics import MeanAbsoluteError, R2Score

        from basetrainer.metric.metric_recorder import MetricRecorder

        return [
            losses_recorder.LossesRecorder(indicator="loss"),          # MSE, in the target's units squared
            MetricRecorder(MeanAbsoluteError(), indicator="MAE"),
            MetricRecorder(R2Score(), indicator="R2"),
            build_scheduler.get_scheduler(cfg.scheduler, optimizer=self.optimizer, lr_init=cfg.lr,
                                          num_epochs=cfg.num_epochs, num_steps=self.num_steps,
                                          milestones=cfg.milestones, num_warn_up=cfg.num_warn_up),
            log_history.LogHistory(log_dir=cfg.log_root, log_freq=cfg.log_freq, logger=self.logger,
                                   indicators=["loss", "MAE", "R2"], is_main_process=self.is_main_process),
            # mode left out: MAE is an error, so the lowest is kept
            model_checkpoint.ModelCheckpoint(model=self.model, optimizer=self.optimizer, model_dir=cfg.model_root,
                                             epochs=cfg.num_epochs, indicator="MAE", logger=self.logger),
        ]


def main(cfg: Any) -> Any:
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    start = time.perf_counter()
    t = RegressionTrainer(cfg)
    history = t.run()
    if t.is_main_process and history.last is not None:
        last = history.last
        # the whole run's lowest MAE, a resumed one included (history holds only this call's epochs)
        ckpt = next(c for c in t.callbacks if isinstance(c, model_checkpoint.ModelCheckpoint))
        at_best = [row for row in history.epochs if row["epoch"] == ckpt.best_epoch]
        r2 = f", R2 {at_best[0]['test/R2']:.4f}" if at_best else ""
        print(f"final test/R2: {last['test/R2']:.4f} test/MAE: {last['test/MAE']:.4f} "
              f"(lowest MAE {ckpt.best:.4f} at epoch {ckpt.best_epoch}{r2}); "
              f"linear regression baseline R2: {t.data['linear_r2']:.4f} MAE: {t.data['linear_mae']:.4f}; "
              f"{last['epoch'] + 1} epochs ({len(history)} in this call) in {time.perf_counter() - start:.1f} s; "
              f"work_dir: {cfg.work_dir}", flush=True)
    return history


def _at_least(kind: type, name: str, low: float) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name} must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"--{name} must be >= {low}, got {text!r}")
        return value
    return parse


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="basetrainer tabular regression example (diabetes)")
    parser.add_argument("-c", "--config_file", default=None, help="optional YAML config (typed flags override it)")
    parser.add_argument("--work_dir", default="work_space/diabetes", help="output folder")
    parser.add_argument("--split_seed", type=int, default=2020, help="random_state of the fixed 80/20 split")
    parser.add_argument("--hidden", type=_at_least(int, "hidden", 1), default=16, help="units per hidden layer")
    parser.add_argument("--depth", type=_at_least(int, "depth", 0), default=1, help="hidden layers (0: linear)")
    parser.add_argument("--activation", default="tanh", choices=sorted(_ACTIVATIONS))
    parser.add_argument("--batch_size", type=_at_least(int, "batch_size", 1), default=32, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--optim_type", default="AdamW")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight_decay", type=float, default=0.3, help="AdamW's decoupled weight decay")
    parser.add_argument("--scheduler", default="cosine")
    parser.add_argument("--milestones", nargs="+", type=int, default=[30, 40])
    parser.add_argument("--num_epochs", type=_at_least(int, "num_epochs", 1), default=50)
    parser.add_argument("--num_warn_up", type=float, default=0, help="epochs of LR warm-up (a fraction too)")
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--num_threads", type=int, default=0,
                        help="torch threads per process (0: torch's choice; DDP on the CPU divides the cores)")
    parser.add_argument("--gpu_id", nargs="*", type=int, default=[0], help="GPU ids ([] = CPU)")
    parser.add_argument("--seed", type=int, default=2020)
    parser.add_argument("--log_freq", type=int, default=50)
    parser.add_argument("--resume", default="", help="'auto' (continue the run in work_dir) or a checkpoint path")
    parser.add_argument("--overwrite", action="store_true", help="move an earlier run in work_dir aside")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--distributed", action="store_true", help="one process per gpu_id entry (DDP)")
    return setup_config.add_engine_flags(parser)   # every other key of the config table: --sync_bn, --ema, ...


def parse_config(argv: Any = None) -> Any:
    parser = get_parser()
    args = parser.parse_args(argv)
    cfg = setup_config.parser_config(args, cfg_updata=True, parser=parser, argv=argv)
    if cfg.distributed and len(cfg.gpu_id) < 2 and not torch.cuda.is_available():
        cfg.gpu_id = [0, 1]     # two CPU processes, as `--distributed --gpu_id 0 1` would start
    return cfg


if __name__ == "__main__":
    with errors.exit_on_usage_error():   # a user error: "error: <message>", exit status 2, no traceback
        cfg = parse_config()
        print(f"basetrainer {basetrainer.__version__}", flush=True)
        launch(main, num_gpus_per_machine=max(1, len(cfg.gpu_id)), dist_url="auto", num_machines=1, machine_rank=0,
               distributed=cfg.distributed, args=(cfg,))
