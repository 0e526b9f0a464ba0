"""Train an image classifier with basetrainer.

With no data arguments it trains resnet18 (32x32) on scikit-learn's handwritten digits, written
once as an ImageFolder under data/digits:

    python examples/example.py                                   # one process (GPU 0 or the CPU)
    python examples/example.py --gpu_id 0 1                      # DataParallel over two GPUs
    python examples/example.py --distributed --gpu_id 0 1        # DDP, two processes
    torchrun --nproc_per_node 2 examples/example.py --distributed
    python examples/example.py --distributed --gpu_id 0 1 --strategy fsdp   # model sharded (FSDP2)
    python examples/example.py --train_data my/train --test_data my/val --net_type mobilenet_v2

With trained weights (``--resume auto``: this work_dir's newest checkpoint; ``--resume`` or
``--finetune`` a .pth file), it evaluates or predicts instead of training:

    python examples/example.py --eval_only --resume auto            # test figures of the run in work_dir
    python examples/example.py --predict my/images --resume auto    # writes <work_dir>/predict/predictions.csv

Every key of the configuration table (docs/configuration.md) is also a flag (``--sync_bn``,
``--balance sqrt``, ...). A mistake in what it is given (a config value, a data folder, a work_dir
holding another run, a missing package) is one line, ``error: ...``, and exit status 2;
BASETRAINER_TRACEBACK=1 shows the traceback instead.
"""
import argparse
import os
import sys

from torchvision import transforms

import basetrainer
from basetrainer.callbacks import log_history, losses_recorder, model_checkpoint
from basetrainer.criterion.criterion import get_criterion
from basetrainer.dataloader.image_folder import image_folder
from basetrainer.engine import trainer
from basetrainer.engine.launch import launch
from basetrainer.metric import accuracy_recorder
from basetrainer.models import build_models
from basetrainer.optimizer.build_optimizer import get_optimizer
from basetrainer.runtime import errors
from basetrainer.scheduler import build_scheduler
from basetrainer.utils import file_utils, log, setup_config, torch_tools

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from prepare_data import DEFAULT_ROOT, prepare_digits  # noqa: E402


class ClassificationTrainer(trainer.EngineTrainer):
    """Image classification: ImageFolder data, a torchvision model, accuracy and loss."""

    def __init__(self, cfg):
        super().__init__(cfg)
        cfg.model_root = os.path.join(cfg.work_dir, "model")
        cfg.log_root = os.path.join(cfg.work_dir, "log")
        if self.is_main_process and not (cfg.get("eval_only") or cfg.get("predict")):   # training writes its run
            file_utils.create_dir(cfg.model_root)
            file_utils.create_dir(cfg.log_root)
            file_utils.copy_file_to_dir(cfg.config_file, cfg.work_dir)
            setup_config.save_config(cfg, os.path.join(cfg.work_dir, "setup_config.yaml"))
        self.logger = log.set_logger(level="info", logfile=os.path.join(cfg.log_root, "train.log"),
                                     is_main_process=self.is_main_process)
        self.build(cfg)
        self.logger.info("work_dir: %s | device: %s | processes: %d | train samples: %d | classes: %d",
                         cfg.work_dir, self.device, self.world_size, self.num_samples, cfg.num_classes)

    def transforms(self, cfg, train):
        w, h = cfg.input_size
        steps = [transforms.Resize([h, w])]
        if train:
            steps.append(transforms.RandomAffine(degrees=8, translate=(0.08, 0.08), scale=(0.9, 1.1)))
        steps += [transforms.ToTensor(), transforms.Normalize(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])]
        return transforms.Compose(steps)

    def build_train_loader(self, cfg, **kwargs):
        dataset = image_folder(cfg.train_data, transform=self.transforms(cfg, train=True), key="train_data")
        cfg.num_classes = len(dataset.classes)
        cfg.classes = dataset.classes
        return self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="train", shuffle=True,
                                     pin_memory=True, drop_last=True, distributed=cfg.distributed)

    def build_test_loader(self, cfg, **kwargs):
        if not cfg.test_data:
            return None
        dataset = image_folder(cfg.test_data, transform=self.transforms(cfg, train=False), key="test_data",
                               classes=cfg.classes)
        return self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="test", shuffle=False,
                                     pin_memory=True, drop_last=False, distributed=cfg.distributed)

    def build_model(self, cfg, **kwargs):
        model = build_models.get_models(cfg.net_type, cfg.input_size, cfg.num_classes, pretrained=cfg.pretrained)
        if cfg.finetune:
            torch_tools.load_weights(model, torch_tools.load_state_dict(cfg.finetune), source=cfg.finetune)
            self.logger.info("finetune: loaded %s", cfg.finetune)
        if cfg.use_prune:
            model = self.prune(model, cfg)
        return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)

    def prune(self, model, cfg):
        from basetrainer.pruning import nni_pruning

        return nni_pruning.model_pruning(model, input_size=cfg.input_size, sparsity=cfg.get("sparsity", 0.5),
                                         reuse=cfg.get("reuse", False),
                                         output_prune=os.path.join(cfg.work_dir, "prune"),
                                         prune_type=cfg.get("prune_type", "l1"))

    def build_criterion(self, cfg, **kwargs):
        return get_criterion(cfg.loss_type, cfg.num_classes, device=self.device)

    def build_optimizer(self, cfg, **kwargs):
        return get_optimizer(self.model, optim_type=cfg.optim_type, lr=cfg.lr, momentum=cfg.momentum,
                             weight_decay=cfg.weight_decay)

    def build_callbacks(self, cfg, **kwargs):
        return [
            accuracy_recorder.AccuracyRecorder(target_names=cfg.classes, indicator="Accuracy", logger=self.logger),
            losses_recorder.LossesRecorder(indicator="loss"),
            build_scheduler.get_scheduler(cfg.scheduler, optimizer=self.optimizer, lr_init=cfg.lr,
                                          num_epochs=cfg.num_epochs, num_steps=self.num_steps,
                                          milestones=cfg.milestones, num_warn_up=cfg.num_warn_up),
            log_history.LogHistory(log_dir=cfg.log_root, log_freq=cfg.log_freq, logger=self.logger,
                                   indicators=["loss", "Accuracy"], is_main_process=self.is_main_process,
                                   loggers=cfg.loggers),   # tensorboard, csv, mlflow, wandb
            model_checkpoint.ModelCheckpoint(model=self.model, optimizer=self.optimizer, model_dir=cfg.model_root,
                                             epochs=cfg.num_epochs, start_save=cfg.start_save,
                                             indicator="Accuracy", logger=self.logger,
                                             save_freq_steps=cfg.get("save_freq_steps", 0)),
        ]


    def predict_step(self, batch):
        """predict()'s rows: the class and the probabilities (a CSV: index, id, class, probs_0, ...)."""
        probs = super().predict_step(batch).float().softmax(dim=1)
        return {"class": probs.argmax(dim=1), "probs": probs}


def use_trained(cfg):
    """--eval_only / --predict: evaluate or predict with the weights of --resume or --finetune."""
    weights = cfg.resume or None
    if not weights and not cfg.finetune:
        raise errors.ConfigError("--eval_only and --predict use trained weights: give --resume auto (the newest "
                                 "checkpoint of --work_dir), --resume <a .pth file>, or --finetune <a weights file>")
    cfg.resume = "auto"   # no new run starts: the trainer must not refuse a work_dir that holds one
    t = ClassificationTrainer(cfg)
    figures = None
    if cfg.eval_only:
        figures = t.evaluate(checkpoint=weights)
        weights = None   # loaded
        if t.is_main_process:
            print("evaluate: " + ", ".join(f"{k} {v:.4f}" for k, v in figures.items() if isinstance(v, float))
                  + f" ({len(t.test_loader.dataset)} test samples)", flush=True)
    if cfg.predict:
        out = cfg.predict_output or os.path.join(cfg.work_dir, "predict", "predictions.csv")
        path = t.predict(cfg.predict, output=out, checkpoint=weights)
        if t.is_main_process:
            print(f"predictions: {path} (columns index, id, class, probs_0..probs_{cfg.num_classes - 1}; "
                  f"classes {list(cfg.classes)})", flush=True)
    return figures


def main(cfg):
    if cfg.get("eval_only") or cfg.get("predict"):
        return use_trained(cfg)
    t = ClassificationTrainer(cfg)
    history = t.run()
    # this call's last epoch, or (a resumed run that had finished: nothing trained now) the run's
    last = history.last or ({**t.logs, "epoch": t.start_epoch - 1} if t.start_epoch else None)
    if t.is_main_process and last is not None:
        key = "test/Accuracy" if "test/Accuracy" in last else "train/Accuracy"
        # the whole run's, a resumed one included (history holds only the epochs of this call)
        ckpt = next(c for c in t.callbacks if isinstance(c, model_checkpoint.ModelCheckpoint))
        best = ckpt.best if ckpt.best is not None else max(v for v in history[key] + [last[key]] if v is not None)
        print(f"final {key}: {last[key]:.4f} (best {best:.4f}) after {last['epoch'] + 1} epochs; "
              f"work_dir: {cfg.work_dir}", flush=True)
    return history


def get_parser():
    parser = argparse.ArgumentParser(description="basetrainer image classification example")
    parser.add_argument("-c", "--config_file", default=os.path.join(HERE, "..", "configs", "config.yaml"),
                        help="YAML config (its values override these defaults; typed flags override it)")
    parser.add_argument("--train_data", nargs="+", default=None, help="train ImageFolder root(s)")
    parser.add_argument("--test_data", nargs="+", default=None, help="test ImageFolder root(s)")
    parser.add_argument("--work_dir", default="work_space", help="output folder")
    parser.add_argument("--net_type", default="resnet18", help="torchvision model name")
    parser.add_argument("--input_size", nargs=2, type=int, default=[224, 224], help="W H")
    parser.add_argument("--batch_size", type=int, default=32, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--optim_type", default="SGD")
    parser.add_argument("--loss_type", default="CrossEntropyLoss")
    parser.add_argument("--scheduler", default="multi-step")
    parser.add_argument("--milestones", nargs="+", type=int, default=[30, 60, 90])
    parser.add_argument("--num_epochs", type=int, default=100)
    parser.add_argument("--num_warn_up", type=float, default=0, help="epochs of linear warm-up (a fraction too)")
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--gpu_id", nargs="*", type=int, default=[0], help="GPU ids ([] = CPU)")
    parser.add_argument("--seed", type=int, default=2020)
    parser.add_argument("--log_freq", type=int, default=50)
    parser.add_argument("--finetune", default="", help="weights file to start from")
    parser.add_argument("--resume", default="", help="'auto' (continue the run in work_dir) or a checkpoint path")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in a work_dir holding an earlier run (it is moved aside, not deleted)")
    parser.add_argument("--amp", default="none", choices=["none", "fp16", "bf16"])
    parser.add_argument("--use_prune", action="store_true", help="prune before training")
    parser.add_argument("--sparsity", type=float, default=0.5, help="fraction of channels pruned per layer")
    parser.add_argument("--prune_type", default="l1", help="l1, l2, fpgm, slim")
    parser.add_argument("--start_save", type=int, default=0,
                        help="0: keep only the best and last checkpoints; N: also each epoch's weights "
                             "from epoch N on; -1: the last 10 epochs' weights")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress bars in a terminal or notebook (--no-progress to turn off)")
    parser.add_argument("--distributed", action="store_true", help="one process per gpu_id entry (DDP)")
    parser.add_argument("--save_freq_steps", type=int, default=0,
                        help="also write the resumable last.pth every N steps (0: at epoch ends only)")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"],
                        help="with --distributed: ddp (every process holds the model) or fsdp (sharded)")
    parser.add_argument("--loggers", nargs="+", default=["tensorboard", "csv"],
                        help="where the figures go: tensorboard csv mlflow wandb (mlflow/wandb: "
                             "pip install \"basetrainer[mlflow]\" / \"basetrainer[wandb]\")")
    parser.add_argument("--eval_only", action="store_true",
                        help="evaluate the weights of --resume (auto or a .pth) or --finetune on --test_data; no training")
    parser.add_argument("--predict", default="", help="a folder of images (or an image): write the model's "
                        "predictions with the weights of --resume or --finetune; no training")
    parser.add_argument("--predict_output", default="",
                        help="--predict's file (.csv or .npz; default <work_dir>/predict/predictions.csv)")
    parser.add_argument("--mlflow_uri", default="", help="MLflow tracking URI (default sqlite:///<work_dir>/mlflow.db)")
    parser.add_argument("--sync_bn", action=argparse.BooleanOptionalAction, default=False,
                        help="with --distributed: BatchNorm with the statistics of the global batch (DDP then "
                             "equals one process epoch by epoch)")
    return setup_config.add_engine_flags(parser)   # every other key of the config table: --momentum, --balance, ...


def parse_config(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    cfg = setup_config.parser_config(args, cfg_updata=True, parser=parser, argv=argv)
    if not cfg.train_data:  # the bundled digits, made on first use
        root = prepare_digits(DEFAULT_ROOT)
        cfg.train_data = os.path.join(root, "train")
        cfg.test_data = cfg.test_data or os.path.join(root, "val")
    return cfg


if __name__ == "__main__":
    with errors.exit_on_usage_error():   # a user error: "error: <message>", exit status 2, no traceback
        cfg = parse_config()
        if not errors.other_rank():   # once per job, also under torchrun and srun
            print(f"basetrainer {basetrainer.__version__}", flush=True)
        launch(main, num_gpus_per_machine=max(1, len(cfg.gpu_id)), dist_url="auto",   # a free port: runs side by side
               num_machines=1, machine_rank=0, distributed=cfg.distributed, args=(cfg,))
