"""The public API of DESIGN.md §1: import paths, names, keywords, a quiet import, and a user
script written against Pytorch-Base-Trainer's API running unchanged."""
import glob
import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import make_image_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(ROOT, "basetrainer")
HEAVY = ("tensorboard", "torch.utils.tensorboard", "nni", "torch_pruning", "matplotlib",
         "onnx", "onnxruntime", "MNN", "ncnn", "pnnx", "openvino")

# (module, attribute) of every name DESIGN.md §1 lists
PUBLIC_NAMES = [
    ("basetrainer", "__version__"),
    ("basetrainer", "EngineTrainer"),
    ("basetrainer", "Engine"),
    ("basetrainer", "Callback"),
    ("basetrainer", "launch"),
    ("basetrainer.engine.trainer", "EngineTrainer"),
    ("basetrainer.engine.launch", "launch"),
    ("basetrainer.criterion.criterion", "get_criterion"),
    ("basetrainer.metric.accuracy_recorder", "AccuracyRecorder"),
    ("basetrainer.callbacks.log_history", "LogHistory"),
    ("basetrainer.callbacks.model_checkpoint", "ModelCheckpoint"),
    ("basetrainer.callbacks.losses_recorder", "LossesRecorder"),
    ("basetrainer.callbacks.multi_losses_recorder", "MultiLossesRecorder"),
    ("basetrainer.scheduler.build_scheduler", "get_scheduler"),
    ("basetrainer.optimizer.build_optimizer", "get_optimizer"),
    ("basetrainer.utils.log", "set_logger"),
    ("basetrainer.utils.file_utils", "create_dir"),
    ("basetrainer.utils.file_utils", "copy_file_to_dir"),
    ("basetrainer.utils.setup_config", "parser_config"),
    ("basetrainer.utils.setup_config", "save_config"),
    ("basetrainer.utils.torch_tools", "set_env_random_seed"),
    ("basetrainer.utils.torch_tools", "load_state_dict"),
    ("basetrainer.models.build_models", "get_models"),
    ("basetrainer.pruning.nni_pruning", "model_pruning"),
]


def _run_python(code: str, cwd: str = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


# ------------------------------------------------------------------------------ names and paths
@pytest.mark.parametrize("module,name", PUBLIC_NAMES, ids=[f"{m}.{n}" for m, n in PUBLIC_NAMES])
def test_public_name_exists(module, name):
    mod = importlib.import_module(module)
    value = getattr(mod, name)
    if name == "__version__":
        assert isinstance(value, str) and re.fullmatch(r"\d+\.\d+\.\d+.*", value)
    else:
        assert callable(value)


def test_design_import_statements_work():
    # the exact statements of DESIGN.md §1 (from ... import module)
    from basetrainer.engine import trainer
    from basetrainer.engine.launch import launch
    from basetrainer.criterion.criterion import get_criterion
    from basetrainer.metric import accuracy_recorder
    from basetrainer.callbacks import log_history, model_checkpoint, losses_recorder, multi_losses_recorder
    from basetrainer.scheduler import build_scheduler
    from basetrainer.optimizer.build_optimizer import get_optimizer
    from basetrainer.utils import log, file_utils, setup_config, torch_tools
    from basetrainer.models import build_models
    from basetrainer.pruning import nni_pruning

    import basetrainer
    assert basetrainer.EngineTrainer is trainer.EngineTrainer
    assert basetrainer.launch is launch
    assert basetrainer.Engine is importlib.import_module("basetrainer.engine.engine").Engine
    assert basetrainer.Callback is importlib.import_module("basetrainer.callbacks.callbacks").Callback
    assert issubclass(trainer.EngineTrainer, basetrainer.Engine)
    # the named modules are the real homes of their names (no alias modules)
    assert get_criterion.__module__ == "basetrainer.criterion.criterion"
    assert get_optimizer.__module__ == "basetrainer.optimizer.build_optimizer"
    assert accuracy_recorder.AccuracyRecorder.__module__ == "basetrainer.metric.accuracy_recorder"
    assert log_history.LogHistory.__module__ == "basetrainer.callbacks.log_history"
    assert model_checkpoint.ModelCheckpoint.__module__ == "basetrainer.callbacks.model_checkpoint"
    assert losses_recorder.LossesRecorder.__module__ == "basetrainer.callbacks.losses_recorder"
    assert multi_losses_recorder.MultiLossesRecorder.__module__ == "basetrainer.callbacks.multi_losses_recorder"
    assert build_scheduler.get_scheduler.__module__ == "basetrainer.scheduler.build_scheduler"
    assert build_models.get_models.__module__ == "basetrainer.models.build_models"
    assert nni_pruning.model_pruning.__module__ == "basetrainer.pruning.nni_pruning"
    assert trainer.EngineTrainer.__module__ == "basetrainer.engine.trainer"
    assert launch.__module__ == "basetrainer.engine.launch"
    for mod, names in ((log, ["set_logger"]), (file_utils, ["create_dir", "copy_file_to_dir"]),
                       (setup_config, ["parser_config", "save_config"]),
                       (torch_tools, ["set_env_random_seed", "load_state_dict"])):
        for n in names:
            assert getattr(mod, n).__module__ == mod.__name__


def test_unknown_attribute_of_package_raises_attribute_error():
    import basetrainer
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        basetrainer.NoSuchThing  # noqa: B018
    assert set(basetrainer.__all__) == {"__version__", "EngineTrainer", "Engine", "Callback", "launch"}


SIGNATURES = [
    ("basetrainer.engine.trainer", "EngineTrainer.build_dataloader",
     ["dataset", "batch_size", "num_workers", "phase", "shuffle", "pin_memory", "drop_last", "distributed"]),
    ("basetrainer.engine.trainer", "EngineTrainer.build_model_parallel", ["model", "gpu_id", "distributed"]),
    ("basetrainer.engine.launch", "launch",
     ["main_func", "num_gpus_per_machine", "dist_url", "num_machines", "machine_rank", "distributed", "args"]),
    ("basetrainer.optimizer.build_optimizer", "get_optimizer",
     ["model", "optim_type", "lr", "momentum", "weight_decay"]),
    ("basetrainer.criterion.criterion", "get_criterion", ["loss_type", "num_classes", "device"]),
    ("basetrainer.scheduler.build_scheduler", "get_scheduler",
     ["scheduler", "optimizer", "lr_init", "num_epochs", "num_steps", "milestones", "num_warn_up"]),
    ("basetrainer.models.build_models", "get_models", ["net_type", "input_size", "num_classes", "pretrained"]),
    ("basetrainer.metric.accuracy_recorder", "AccuracyRecorder", ["target_names", "indicator"]),
    ("basetrainer.callbacks.losses_recorder", "LossesRecorder", ["indicator"]),
    ("basetrainer.callbacks.multi_losses_recorder", "MultiLossesRecorder", ["indicator"]),
    ("basetrainer.callbacks.log_history", "LogHistory",
     ["log_dir", "log_freq", "logger", "indicators", "is_main_process"]),
    ("basetrainer.callbacks.model_checkpoint", "ModelCheckpoint",
     ["model", "optimizer", "moder_dir", "model_dir", "epochs", "start_save", "indicator", "logger"]),
    ("basetrainer.pruning.nni_pruning", "model_pruning", ["model", "input_size", "sparsity", "reuse", "output_prune"]),
    ("basetrainer.utils.log", "set_logger", ["level", "logfile", "is_main_process"]),
    ("basetrainer.utils.file_utils", "create_dir", ["path"]),
    ("basetrainer.utils.file_utils", "copy_file_to_dir", ["file", "dir"]),
    ("basetrainer.utils.setup_config", "parser_config", ["args", "cfg_updata"]),
    ("basetrainer.utils.setup_config", "save_config", ["cfg"]),
    ("basetrainer.utils.torch_tools", "set_env_random_seed", ["seed"]),
    ("basetrainer.utils.torch_tools", "load_state_dict", ["model_path"]),
]


@pytest.mark.parametrize("module,qualname,keywords", SIGNATURES, ids=[s[1] for s in SIGNATURES])
def test_documented_keywords_are_accepted(module, qualname, keywords):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    params = inspect.signature(obj).parameters
    missing = [k for k in keywords if k not in params]
    assert missing == [], f"{qualname} lacks keywords {missing}; has {list(params)}"
    # positional order of the documented keywords is kept (scripts pass them positionally too)
    positional = [n for n, p in params.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and n != "self"]
    documented_positional = [k for k in keywords if k in positional and k != "model_dir"]
    assert positional[:len(documented_positional)] == documented_positional


def test_setup_config_save_config_second_argument_is_a_path(tmp_path):
    from basetrainer.utils import setup_config
    path = tmp_path / "a" / "cfg.yaml"
    setup_config.save_config(setup_config.Config(lr=0.5), str(path))
    assert path.read_text(encoding="utf-8").strip() == "lr: 0.5"


def test_engine_trainer_documented_attributes(tmp_path):
    from conftest import ToyTrainer, toy_cfg
    t = ToyTrainer(toy_cfg(n_train=32, batch_size=8, n_test=8))
    for name in ("is_main_process", "world_size", "local_rank", "device", "num_samples", "num_steps", "model",
                 "optimizer", "criterion", "train_loader", "test_loader", "callbacks"):
        assert hasattr(t, name), name
    assert (t.is_main_process, t.world_size, t.local_rank, str(t.device)) == (True, 1, 0, "cpu")
    assert (t.num_samples, t.num_steps) == (32, 4)
    assert t.callbacks == []


def test_model_checkpoint_accepts_both_folder_spellings(tmp_path):
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
    a = ModelCheckpoint(moder_dir=str(tmp_path / "a"), indicator="Accuracy")
    b = ModelCheckpoint(model_dir=str(tmp_path / "b"), indicator="Accuracy")
    assert (a.model_dir, a.moder_dir) == (str(tmp_path / "a"),) * 2
    assert (b.model_dir, b.moder_dir) == (str(tmp_path / "b"),) * 2
    with pytest.raises(ValueError, match="model_dir"):
        ModelCheckpoint(indicator="Accuracy")


# ------------------------------------------------------------------------------ quiet import
def test_this_checkout_is_imported():
    import basetrainer
    assert os.path.dirname(os.path.abspath(basetrainer.__file__)) == PACKAGE_DIR
    with open(os.path.join(PACKAGE_DIR, "__init__.py"), encoding="utf-8") as f:
        declared = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', f.read(), re.M).group(1)
    assert basetrainer.__version__ == declared
    assert basetrainer.__version__ != "1.0.4"  # the PyPI package of the same name


@pytest.mark.distributed
def test_subprocess_imports_this_checkout_from_elsewhere(tmp_path):
    # a user script run from another folder (as in test_user_script_runs_unchanged) gets this checkout too
    proc = _run_python("import basetrainer, os; print(os.path.dirname(os.path.abspath(basetrainer.__file__)))",
                       cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == PACKAGE_DIR


@pytest.mark.distributed
def test_import_prints_nothing_and_loads_no_heavy_dependency():
    code = f"import sys\nimport basetrainer\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules), " \
           f"'torch' in sys.modules, end='')"
    proc = _run_python("import basetrainer")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[] False"
    assert proc.stderr == ""


@pytest.mark.distributed
def test_importing_public_modules_loads_no_heavy_dependency():
    code = textwrap.dedent(f"""
        import sys
        from basetrainer.engine import trainer
        from basetrainer.engine.launch import launch
        from basetrainer.callbacks import log_history, model_checkpoint, losses_recorder, multi_losses_recorder
        from basetrainer.metric import accuracy_recorder
        from basetrainer.criterion.criterion import get_criterion
        from basetrainer.scheduler import build_scheduler
        from basetrainer.optimizer.build_optimizer import get_optimizer
        from basetrainer.utils import log, file_utils, setup_config, torch_tools
        from basetrainer.models import build_models
        from basetrainer.pruning import nni_pruning
        import basetrainer
        basetrainer.EngineTrainer, basetrainer.Engine, basetrainer.Callback, basetrainer.launch
        print(sorted(m for m in {HEAVY!r} if m in sys.modules), end='')
    """)
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]"
    assert proc.stderr == ""


# ------------------------------------------------------------------------------ a PBT-style script
USER_SCRIPT = '''
# -*-coding: utf-8 -*-
"""A training script written for Pytorch-Base-Trainer (pip install basetrainer 1.0.x)."""
import os
import argparse
import torch
import torch.nn as nn
from torchvision import transforms, datasets
from basetrainer.engine import trainer
from basetrainer.engine.launch import launch
from basetrainer.criterion.criterion import get_criterion
from basetrainer.metric import accuracy_recorder
from basetrainer.callbacks import log_history, model_checkpoint, losses_recorder
from basetrainer.scheduler import build_scheduler
from basetrainer.optimizer.build_optimizer import get_optimizer
from basetrainer.utils import log, file_utils, setup_config, torch_tools
from basetrainer.models import build_models

print("torch version:{}".format(torch.__version__))


class ClassificationTrainer(trainer.EngineTrainer):
    """ Training Pipeline """

    def __init__(self, cfg):
        super(ClassificationTrainer, self).__init__(cfg)
        torch_tools.set_env_random_seed()
        cfg.model_root = os.path.join(cfg.work_dir, "model")
        cfg.log_root = os.path.join(cfg.work_dir, "log")
        if self.is_main_process:
            file_utils.create_dir(cfg.work_dir)
            file_utils.create_dir(cfg.model_root)
            file_utils.create_dir(cfg.log_root)
            file_utils.copy_file_to_dir(cfg.config_file, cfg.work_dir)
            setup_config.save_config(cfg, os.path.join(cfg.work_dir, "setup_config.yaml"))
        self.logger = log.set_logger(level="debug",
                                     logfile=os.path.join(cfg.log_root, "train.log"),
                                     is_main_process=self.is_main_process)
        self.build(cfg)
        self.logger.info("=" * 60)
        self.logger.info("work_dir          :{}".format(cfg.work_dir))
        self.logger.info("num_samples(train):{}".format(self.num_samples))
        self.logger.info("=" * 60)

    def build_optimizer(self, cfg, **kwargs):
        optimizer = get_optimizer(self.model,
                                  optim_type=cfg.optim_type,
                                  lr=cfg.lr,
                                  momentum=cfg.momentum,
                                  weight_decay=cfg.weight_decay)
        return optimizer

    def build_criterion(self, cfg, **kwargs):
        criterion = get_criterion(cfg.loss_type, cfg.num_classes, device=self.device)
        return criterion

    def build_train_loader(self, cfg, **kwargs):
        transform = transforms.Compose([transforms.Resize(cfg.input_size[::-1]),
                                        transforms.Grayscale(3), transforms.ToTensor()])
        dataset = datasets.ImageFolder(root=cfg.train_data, transform=transform)
        cfg.num_classes = len(dataset.classes)
        cfg.classes = dataset.classes
        loader = self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="train",
                                       shuffle=True, pin_memory=False, drop_last=True,
                                       distributed=cfg.distributed)
        return loader

    def build_test_loader(self, cfg, **kwargs):
        transform = transforms.Compose([transforms.Resize(cfg.input_size[::-1]),
                                        transforms.Grayscale(3), transforms.ToTensor()])
        dataset = datasets.ImageFolder(root=cfg.test_data, transform=transform)
        loader = self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="test",
                                       shuffle=False, pin_memory=False, drop_last=False,
                                       distributed=cfg.distributed)
        return loader

    def build_model(self, cfg, **kwargs):
        model = build_models.get_models(net_type=cfg.net_type, input_size=cfg.input_size,
                                        num_classes=cfg.num_classes, pretrained=True)
        if cfg.finetune:
            self.logger.info("finetune:{}".format(cfg.finetune))
            state_dict = torch_tools.load_state_dict(cfg.finetune)
            model.load_state_dict(state_dict)
        model = self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)
        return model

    def build_callbacks(self, cfg, **kwargs):
        self.logger.info("build_callbacks")
        acc_record = accuracy_recorder.AccuracyRecorder(target_names=cfg.classes, indicator="Accuracy")
        loss_record = losses_recorder.LossesRecorder(indicator="loss")
        lr_scheduler = build_scheduler.get_scheduler(cfg.scheduler,
                                                     optimizer=self.optimizer,
                                                     lr_init=cfg.lr,
                                                     num_epochs=cfg.num_epochs,
                                                     num_steps=self.num_steps,
                                                     milestones=cfg.milestones,
                                                     num_warn_up=cfg.num_warn_up)
        logs = log_history.LogHistory(log_dir=cfg.log_root,
                                      log_freq=cfg.log_freq,
                                      logger=self.logger,
                                      indicators=["loss", "Accuracy"],
                                      is_main_process=self.is_main_process)
        checkpointer = model_checkpoint.ModelCheckpoint(model=self.model,
                                                        optimizer=self.optimizer,
                                                        moder_dir=cfg.model_root,
                                                        epochs=cfg.num_epochs,
                                                        start_save=-1,
                                                        indicator="Accuracy",
                                                        logger=self.logger)
        callbacks = [acc_record, loss_record, lr_scheduler, logs, checkpointer]
        return callbacks

    def run(self, logs: dict = {}):
        self.logger.info("start train")
        super().run(logs)


def main(cfg):
    t = ClassificationTrainer(cfg)
    return t.run()


def get_parser():
    config_file = os.path.join(os.path.dirname(__file__), "config.yaml")
    parser = argparse.ArgumentParser(description="Training Pipeline")
    parser.add_argument("-c", "--config_file", help="configs file", default=config_file, type=str)
    return parser


if __name__ == "__main__":
    parser = get_parser()
    cfg = setup_config.parser_config(parser.parse_args(), cfg_updata=True)
    launch(main,
           num_gpus_per_machine=len(cfg.gpu_id),
           dist_url="tcp://127.0.0.1:28661",
           num_machines=1,
           machine_rank=0,
           distributed=cfg.distributed,
           args=(cfg,))
'''

USER_CONFIG = """\
train_data: {train}
test_data: {test}
work_dir: {work}
net_type: resnet18
input_size: [16, 16]
batch_size: 4
lr: 0.01
optim_type: SGD
loss_type: CrossEntropyLoss
scheduler: multi-step
milestones: [1]
momentum: 0.9
num_epochs: 2
num_warn_up: 1
num_workers: 0
weight_decay: 0.0005
gpu_id: [0]
log_freq: 2
finetune: ""
use_prune: false
progress: false
distributed: false
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_user_script_runs_unchanged(tmp_path):
    train = make_image_folder(str(tmp_path / "data" / "train"), ["cat", "dog"], per_class=4, size=8)
    test = make_image_folder(str(tmp_path / "data" / "test"), ["cat", "dog"], per_class=2, size=8)
    work = tmp_path / "work"
    script_dir = tmp_path / "project"
    script_dir.mkdir()
    (script_dir / "train.py").write_text(USER_SCRIPT, encoding="utf-8")
    (script_dir / "config.yaml").write_text(USER_CONFIG.format(train=train, test=test, work=work), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["TORCH_HOME"] = str(tmp_path / "torch_home")  # no cached weights: pretrained=True only warns
    proc = subprocess.run([sys.executable, "train.py"], cwd=str(script_dir), capture_output=True, text=True,
                          timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "torch version:" in proc.stdout
    # the config file is copied and the merged config saved
    assert (work / "config.yaml").read_text(encoding="utf-8") == (script_dir / "config.yaml").read_text(encoding="utf-8")
    import yaml
    saved = yaml.safe_load((work / "setup_config.yaml").read_text(encoding="utf-8"))
    assert saved["batch_size"] == 4 and saved["milestones"] == [1] and saved["model_root"] == str(work / "model")
    assert saved["config_file"].endswith("config.yaml") and saved["seed"] == 2020  # engine default filled in
    # one warning for the weights that can't be had offline, naming the file
    assert out.count("not available offline") == 1
    assert "resnet18-" in out and ".pth" in out
    # checkpoints
    best = glob.glob(str(work / "model" / "best_model_*.pth"))
    assert len(best) == 1, os.listdir(work / "model")
    assert re.fullmatch(r"best_model_00[01]_\d\.\d{4}\.pth", os.path.basename(best[0]))
    import torch
    weights = torch.load(best[0], weights_only=True)
    assert weights["fc.weight"].shape == (2, 512)
    assert os.path.isfile(work / "model" / "last.pth")
    # log file, TensorBoard events, history.csv
    log_text = (work / "log" / "train.log").read_text(encoding="utf-8")
    assert "start train" in log_text and "num_samples(train):8" in log_text
    assert "epoch 1/2 done" in log_text
    assert len(glob.glob(str(work / "log" / "events.out.tfevents.*"))) >= 1
    rows = (work / "log" / "history.csv").read_text(encoding="utf-8").strip().splitlines()
    assert len(rows) == 3  # header + 2 epochs
    header = rows[0].split(",")
    assert {"epoch", "train/loss", "test/Accuracy", "lr"} <= set(header)
    # test/Accuracy is a fraction of 4 test images
    acc = float(rows[2].split(",")[header.index("test/Accuracy")])
    assert acc in (0.0, 0.25, 0.5, 0.75, 1.0)
