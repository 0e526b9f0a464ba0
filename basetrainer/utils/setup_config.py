"""Configuration: YAML + argparse merged into one :class:`Config`, with documented defaults.

Precedence in ``parser_config(args, cfg_updata=True)``: argparse defaults < YAML < flags typed on
the command line. Every key the engine reads has a default (:data:`ENGINE_KEYS`), so a config
holding only what a script uses works; scripts may add keys of their own.
"""
import argparse
import copy
import difflib
import logging
import math
import numbers
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from basetrainer.runtime.errors import ConfigError, ConfigTypeError, MissingExtraError, PathError
from basetrainer.runtime.watchdog import check_timeout
from basetrainer.utils import typed_flags

logger = logging.getLogger(__name__)


class Config(dict):
    """A dict whose keys are also attributes: ``cfg.lr``, ``cfg["lr"]``, ``cfg.new_key = 1``.

    Nested dicts become Configs. It pickles (it crosses process boundaries in ``launch``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, dict) and not isinstance(value, Config):
            value = Config(value)
        super().__setitem__(key, value)

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no key {key!r}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __reduce__(self) -> Tuple[Any, ...]:
        return (Config, (dict(self),))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Config":
        return Config(copy.deepcopy(dict(self), memo))

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def to_dict(self) -> Dict[str, Any]:
        """A plain-dict deep copy (nested Configs too)."""
        return {k: (v.to_dict() if isinstance(v, Config) else copy.deepcopy(v)) for k, v in self.items()}


# ---------------------------------------------------------------------------------- the keys
# name: (default, accepted types, meaning). "number" = int or float; "ints" = list of ints;
# "size" = two positive ints; "path" = str or list of str or None; "bool" = bool.
ENGINE_KEYS: Dict[str, Tuple[Any, str, str]] = {
    "train_data": (None, "path", "training data: a folder (ImageFolder) or a list of folders"),
    "test_data": (None, "path", "evaluation data (same forms); none skips the test phase"),
    "work_dir": ("work_space", "str", "output folder: checkpoints in model/, logs in log/"),
    "net_type": ("resnet18", "str", "model name (any torchvision classification model)"),
    "input_size": ([224, 224], "size", "model input [W, H]"),
    "batch_size": (32, "int", "global batch: all processes together, per optimizer step"),
    "lr": (0.1, "number", "initial learning rate (after warm-up): finite, >= 0 (0 = weights stay)"),
    "optim_type": ("SGD", "str", "SGD, Adam, AdamW, RMSprop"),
    "loss_type": ("CrossEntropyLoss", "str", "CrossEntropyLoss (CELoss), LabelSmoothing, FocalLoss"),
    "scheduler": ("multi-step", "str", "multi-step, cosine, step, exponential, constant"),
    "milestones": ([30, 60, 90], "ints", "0-based epochs from which the LR is multiplied by 0.1"),
    "momentum": (0.9, "number", "SGD/RMSprop momentum"),
    "num_epochs": (100, "int", "epochs to train"),
    "num_warn_up": (0, "number", "epochs of linear LR warm-up, applied per step"),
    "num_workers": (0, "int", "DataLoader worker processes per training process"),
    "weight_decay": (5e-4, "number", "weight decay"),
    "gpu_id": ([0], "ints", "GPU ids; several without distributed = DataParallel; [] = CPU"),
    "log_freq": (50, "int", "steps between log lines (and reads of running figures)"),
    "finetune": ("", "optpath", "weights file to start from (weights only)"),
    "use_prune": (False, "bool", "prune the model before training"),
    "progress": (True, "bool", "show progress bars (main process)"),
    "distributed": (False, "bool", "one process per gpu_id entry (DDP)"),
    "seed": (2020, "int", "random seed: the train order depends only on (seed, epoch)"),
    "pretrained": (False, "boolpath", "torchvision weights from the local cache, or a weights file"),
    "resume": ("", "optpath", "'' (a new run), 'auto' (continue this run's newest loadable checkpoint) or a checkpoint path"),
    "overwrite": (False, "bool", "start a new run in a work_dir holding another run: move the old one aside"),
    "amp": ("none", "str", "mixed precision: none, fp16 (CUDA), bf16"),
    "accumulate_steps": (1, "int", "micro-batches per optimizer step"),
    "loss_reduction": ("mean", "str", "what run_step's loss is over the batch: mean (per sample) or sum"),
    "seed_per_sample": (True, "bool", "seed random draws of each train sample from (seed, epoch, index)"),
    "balance": ("none", "str", "class-balanced resampling of the train set each epoch: none, mean (every class "
                               "alike), log, sqrt (per-class shares grow as log / sqrt of the class size)"),
    "channels_last": (False, "bool", "channels-last memory format for 4-D inputs and the model"),
    "compile": (False, "bool", "wrap the model with torch.compile"),
    "clip_grad_norm": (0.0, "number", "clip the gradient norm to this value (0 = off)"),
    "sync_bn": (False, "bool", "convert BatchNorm to SyncBatchNorm under ddp and fsdp (statistics of the global batch)"),
    "find_unused_parameters": (False, "bool", "DDP option for models with unused parameters"),
    "strategy": ("ddp", "str", "how distributed processes hold the model: ddp (each the whole model) or fsdp "
                               "(parameters, gradients and optimizer state sharded; FSDP2)"),
    "fsdp_wrap": ([], "strs", "fsdp: class names of the blocks to shard one by one (default: the model's "
                              "repeated blocks)"),
    "reshard_after_forward": (True, "bool", "fsdp: free a block's gathered parameters after its forward"),
    "activation_checkpointing": (False, "bool", "fsdp: recompute the sharded blocks' activations in the backward"),
    "fsdp_meta_init": ("auto", "autobool", "fsdp: ranks other than 0 build the model on the meta device: auto "
                                           "(built normally where its constructor needs real values), true, false"),
    "loss_in_replica": (False, "bool", "DataParallel: each replica computes its own loss (less memory on GPU 0)"),
    "start_save": (0, "optint", "ModelCheckpoint: 0 = best + last only; N = per-epoch files from epoch N; "
                                "None/-1 = the last 10"),
    "loggers": (["tensorboard", "csv"], "loggers", "where LogHistory's figures go: any of tensorboard, csv "
                                                    "(history.csv), mlflow, wandb (extras mlflow / wandb)"),
    "mlflow_uri": ("", "optpath", "MLflow tracking URI; '' = sqlite:///<work_dir>/mlflow.db"),
    "tracker_deadline": (60.0, "number", "seconds one call to a tracker (MLflow, W&B: starting the run, a log, an "
                                         "upload, ending the run) may take before it is turned off with one "
                                         "warning; training goes on"),
    "data_wait_warn": (0.3, "number", "a share of an epoch's training (0.3 = 30 %): when a rank waited for its "
                                      "train loader longer, rank 0 logs one line of advice naming it; 0 = never"),
    "stall_timeout": (1800.0, "number", "seconds a process may go without progress (no train step, test batch or "
                                        "collective returning) before the job is ended with a report naming each "
                                        "rank's place and exit status 3; 0 = off. The process group's timeout "
                                        "is this + 60 s"),
    "schedule_on_resume": ("stretch", "str", "a resume that changes num_epochs: stretch (the LR schedule is "
                                             "recomputed for the new num_epochs and goes on from the step reached) "
                                             "or restart (a new schedule, warm-up included, over the epochs left)"),
}

# The names ``loggers`` accepts (LogHistory writes the first two; basetrainer.callbacks.trackers
# has the others).
LOGGERS = ("tensorboard", "csv", "mlflow", "wandb")


def engine_defaults() -> Config:
    """A Config holding the default of every engine key."""
    return Config({k: copy.deepcopy(v[0]) for k, v in ENGINE_KEYS.items()})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_CHECKS = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an integer"),
    "optint": (lambda v: v is None or _is_int(v), "an integer or null"),
    "number": (lambda v: (_is_int(v) or isinstance(v, float)), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "autobool": (lambda v: isinstance(v, bool) or (isinstance(v, str) and v.lower() in ("auto", "true", "false")),
                 "auto, true or false"),
    "ints": (lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v), "a list of integers"),
    "size": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(x) and x > 0 for x in v),
             "two positive integers [W, H]"),
    "path": (lambda v: v is None or isinstance(v, str) or
             (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)),
             "a path, a list of paths, or null"),
    "optpath": (lambda v: v is None or v is False or isinstance(v, str), "a path, '' or null"),
    "boolpath": (lambda v: isinstance(v, (bool, str)) or v is None, "true, false or a path"),
    "strs": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v), "a list of names"),
    "loggers": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
                f"a list of names from {list(LOGGERS)}"),
}


def parse_loggers(value: Any, key: str = "loggers") -> List[str]:
    """``value`` as a list of logger names: a list, or one string (``"mlflow"``,
    ``"tensorboard,mlflow"``); lower-cased, each once, in the order given.

    Raises:
        TypeError: not a string or a list of strings.
        ValueError: an unknown name (the valid ones are listed).
    """
    if isinstance(value, str):
        value = [v for v in value.replace(",", " ").split() if v]
    ok, expected = _CHECKS["loggers"]
    if not ok(value):
        raise ConfigTypeError(f"config key {key!r} = {value!r} ({type(value).__name__}) must be {expected}, "
                        f"e.g. [tensorboard, csv, mlflow]")
    names = list(dict.fromkeys(v.strip().lower() for v in value))
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ConfigError(f"config key {key!r} = {list(value)!r}: unknown logger {unknown[0]!r}; choose from "
                         f"{list(LOGGERS)} (e.g. loggers: [tensorboard, csv, mlflow])")
    return names


# The values ``balance`` accepts (basetrainer.dataloader.data_resample.CONFIG_CHOICES).
BALANCE_CHOICES = ("none", "mean", "log", "sqrt")

# The values ``schedule_on_resume`` accepts (basetrainer.scheduler.build_scheduler.LRSchedulerCallback).
SCHEDULE_ON_RESUME = ("stretch", "restart")

# The rule for a learning rate, shared by the config and the builders that take one.
LR_RULE = ("must be a finite number >= 0; set it to e.g. 0.1 (0 is allowed: the weights stay as they are, "
           "for evaluation-only runs or BatchNorm recalibration)")


# The rule for LR milestones, shared by the config and get_scheduler.
MILESTONES_RULE = ("must be 0-based epochs, integers >= 0, from which the LR is multiplied by gamma "
                   "(e.g. [30, 60, 90]); a negative one counts as passed from the start and would decay the LR of the whole run: remove it")


def valid_milestones(value: Any) -> bool:
    """Whether ``value`` is a list of LR milestones: integers >= 0 (not bools)."""
    return isinstance(value, (list, tuple)) and all(
        isinstance(m, numbers.Integral) and not isinstance(m, bool) and m >= 0 for m in value)


def valid_lr(value: Any) -> bool:
    """Whether ``value`` is a learning rate: a finite real number >= 0 (not a bool)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0)


def validate(cfg: Any) -> None:
    """Check the type of every engine key present in ``cfg``.

    Raises:
        TypeError: naming the key, the value and the expected type.
        ValueError: a value of the right type out of range (batch_size <= 0, ...).
    """
    for key, (_, kind, meaning) in ENGINE_KEYS.items():
        if key not in cfg:
            continue
        value = cfg[key]
        if kind == "ints" and _is_int(value):  # gpu_id: 0 means [0]
            cfg[key] = value = [value]
        if kind == "strs" and isinstance(value, str):  # fsdp_wrap: Block means [Block]
            cfg[key] = value = [v for v in value.replace(",", " ").split() if v]
        if kind == "loggers":
            cfg[key] = parse_loggers(value, key)
            continue
        if kind == "number" and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                cfg[key] = value = float(value)
            except ValueError:
                pass
        ok, expected = _CHECKS[kind]
        if not ok(value):
            raise ConfigTypeError(f"config key {key!r} = {value!r} ({type(value).__name__}) must be {expected} "
                            f"({meaning})")
    for key in ("batch_size", "num_epochs", "log_freq", "accumulate_steps"):
        if key in cfg and cfg[key] <= 0:
            raise ConfigError(f"config key {key!r} = {cfg[key]!r} must be a positive integer")
    if "tracker_deadline" in cfg and not 0 < cfg["tracker_deadline"] < math.inf:
        raise ConfigError(f"config key 'tracker_deadline' = {cfg['tracker_deadline']!r} must be a positive number of "
                         f"seconds (default 60); to go without a tracker, remove it from loggers")
    if "data_wait_warn" in cfg and not 0 <= cfg["data_wait_warn"] <= 1:   # NaN too
        raise ConfigError(f"config key 'data_wait_warn' = {cfg['data_wait_warn']!r} must be a share between 0 and 1 "
                          f"(default 0.3: advice when a rank waits for data over 30 % of an epoch's training; "
                          f"0: never)")
    if "stall_timeout" in cfg:
        cfg["stall_timeout"] = check_timeout(cfg["stall_timeout"])
    trackers = [x for x in (cfg.get("loggers") or []) if str(x).lower() in ("mlflow", "wandb")]
    deadline = cfg.get("tracker_deadline") or ENGINE_KEYS["tracker_deadline"][0]
    if trackers and cfg.get("stall_timeout") and deadline >= cfg["stall_timeout"]:
        raise ConfigError(f"config keys 'stall_timeout' = {cfg['stall_timeout']!r} and 'tracker_deadline' = "
                          f"{deadline!r}: a call to {', '.join(trackers)} may take tracker_deadline seconds, which "
                          f"the stall watchdog would end the job for; give stall_timeout more than "
                          f"tracker_deadline (or stall_timeout: 0)")
    for key in ("num_workers", "num_warn_up", "weight_decay", "clip_grad_norm", "momentum"):
        value = cfg.get(key) if key in cfg else None
        if value is not None and (not math.isfinite(value) or value < 0):   # NaN passes a plain "< 0"
            raise ConfigError(f"config key {key!r} = {value!r} must be >= 0 and finite")
    if "seed" in cfg and not -2 ** 62 <= cfg["seed"] < 2 ** 62:   # the loaders add rank and epoch offsets
        raise ConfigError(f"config key 'seed' = {cfg['seed']!r} is out of range: use an integer of magnitude "
                         f"below 2**62 (e.g. 2020)")
    if "balance" in cfg and str(cfg["balance"]).lower() not in BALANCE_CHOICES:
        raise ConfigError(f"config key 'balance' = {cfg['balance']!r} is not one of {list(BALANCE_CHOICES)}: none "
                         f"(no resampling), mean, log or sqrt (see basetrainer.dataloader.data_resample)")
    if "schedule_on_resume" in cfg and cfg["schedule_on_resume"] not in SCHEDULE_ON_RESUME:
        raise ConfigError(f"config key 'schedule_on_resume' = {cfg['schedule_on_resume']!r} is not one of "
                          f"{list(SCHEDULE_ON_RESUME)}: stretch (recompute the LR schedule for a changed num_epochs) "
                          f"or restart (a new schedule over the epochs left)")
    if "milestones" in cfg and not valid_milestones(cfg["milestones"]):
        raise ConfigError(f"config key 'milestones' = {cfg['milestones']!r} {MILESTONES_RULE}")
    if "lr" in cfg and not valid_lr(cfg["lr"]):
        raise ConfigError(f"config key 'lr' = {cfg['lr']!r} {LR_RULE}")


def with_defaults(cfg: Any) -> Any:
    """Fill every missing engine key of ``cfg`` in place with its default; return the config to use.

    A Config, an EasyDict or another dict with attribute access is filled and returned itself. A
    plain dict or an argparse Namespace is filled in place too (the caller's object shows the
    defaults), and a Config of the same values is returned, so that ``cfg.key`` works.
    """
    target = vars(cfg) if isinstance(cfg, argparse.Namespace) else (Config() if cfg is None else cfg)
    for key, (default, _, _) in ENGINE_KEYS.items():
        if key not in target:
            target[key] = copy.deepcopy(default)
    return Config(target) if type(target) is dict else target


# ---------------------------------------------------------------------------------- YAML
def load_config(config_file: str) -> Config:
    """Read a YAML file into a Config.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the YAML does not parse (line and column given) or is not a mapping.
    """
    import yaml

    if not os.path.isfile(config_file):
        raise PathError(f"config_file {config_file!r} does not exist")
    with open(config_file, encoding="utf-8") as f:
        text = f.read()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"config_file {config_file!r} is not valid YAML{where}: {problem}") from None
    if data is None:
        return Config()
    if not isinstance(data, dict):
        raise ConfigError(f"config_file {config_file!r} must hold a mapping of keys to values, "
                         f"got {type(data).__name__}")
    return Config(data)


def save_config(cfg: Any, config_file: str) -> str:
    """Write ``cfg`` as YAML (loads back equal for plain values; others are written as text)."""
    import yaml

    from basetrainer.runtime import atomic
    from basetrainer.runtime.checkpoint import plain

    data = vars(cfg) if isinstance(cfg, argparse.Namespace) else dict(cfg)
    text = yaml.safe_dump(plain(data), sort_keys=False, allow_unicode=True)
    return atomic.write_atomically(text, config_file)


# ---------------------------------------------------------------------------------- argparse
def _optint(text: str) -> Optional[int]:
    return None if text.strip().lower() in ("none", "null") else int(text)


def _boolpath(text: str) -> Any:
    return {"true": True, "false": False}.get(text.strip().lower(), text)


# how a flag reads each kind of ENGINE_KEYS value from the command line
_FLAG_FORMS: Dict[str, Dict[str, Any]] = {
    "str": {"type": str}, "int": {"type": int}, "optint": {"type": _optint, "metavar": "INT|none"},
    "number": {"type": float}, "bool": {"action": argparse.BooleanOptionalAction},
    "autobool": {"choices": ["auto", "true", "false"]}, "ints": {"nargs": "*", "type": int},
    "size": {"nargs": 2, "type": int, "metavar": ("W", "H")}, "path": {"nargs": "+"}, "optpath": {"type": str},
    "boolpath": {"type": _boolpath, "metavar": "true|false|PATH"}, "strs": {"nargs": "*"},
    "loggers": {"nargs": "+", "metavar": "NAME"},
}


def add_engine_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give ``parser`` a ``--<key>`` flag for every engine key it has no flag for yet.

    Each flag's default is the key's default, and its help the key's meaning (the table of
    docs/configuration.md), so every documented key can be typed on the command line
    (``--sync_bn``, ``--balance sqrt``, ``--no-seed_per_sample``); true/false keys take
    ``--key`` / ``--no-key``. A script's own flags (declared before) are kept as they are.

    Returns:
        ``parser``.
    """
    for key, (default, kind, meaning) in ENGINE_KEYS.items():
        text = meaning.replace("%", "%%") + ("" if kind == "bool" else f" (default: {default!r})")  # bool: argparse's
        try:
            parser.add_argument(f"--{key}", default=copy.deepcopy(default), help=text, **_FLAG_FORMS[kind])
        except argparse.ArgumentError:   # the script declares --key itself
            continue
    return parser


def _warn_unknown(yaml_keys: Iterable[str], known: Iterable[str], config_file: str) -> None:
    known = sorted(set(known))
    for key in yaml_keys:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else " (kept as a key of your script's own)"
        logger.warning("config_file %s: unknown key %r%s", config_file, key, hint)


def parser_config(args: Any, cfg_updata: bool = True, parser: Optional[argparse.ArgumentParser] = None,
                  argv: Optional[Sequence[str]] = None) -> Config:
    """Merge argparse values with the YAML file named by ``args.config_file``.

    Args:
        args: the parsed namespace (or a dict).
        cfg_updata: True: argparse defaults < YAML < flags typed on the command line.
            False: argparse values win over YAML (the original project's meaning).
        parser: the parser that made ``args``; with it, typed flags are found exactly (short
            options too). If None, the caller's parser is used when one of its variables (or a
            variable of its callers) holds the parser that made ``args``; failing that, typed
            flags are found in ``argv`` by their ``--name`` and each other typed option (``-b``)
            is named in a warning (see :mod:`basetrainer.utils.typed_flags`).
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        A :class:`Config`: every engine key present (with its default where nobody set it),
        validated, and ``config_file`` set.

    Raises:
        ValueError / TypeError / FileNotFoundError: unreadable YAML or a wrong value, naming the key.
    """
    if isinstance(args, argparse.Namespace):
        arg_values = dict(vars(args))
    else:
        arg_values = dict(args or {})
        args = argparse.Namespace(**arg_values)
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file = arg_values.get("config_file")
    merged: Dict[str, Any] = dict(arg_values)
    if config_file:
        yaml_cfg = load_config(config_file)
        _warn_unknown(yaml_cfg, list(arg_values) + list(ENGINE_KEYS) + ["config_file"], config_file)
        if cfg_updata:
            typed = typed_flags.typed_keys(args, argv, parser, caller=sys._getframe(1))
            merged.update(yaml_cfg)
            merged.update({k: arg_values[k] for k in typed if k in arg_values})
        else:
            merged = {**dict(yaml_cfg), **arg_values}
    merged["config_file"] = config_file
    merged.update(trial_overrides())
    cfg = with_defaults(Config(merged))
    validate(cfg)
    return cfg


#: the environment variable naming a search trial's overrides (set by ``python -m basetrainer.tune``)
TRIAL_ENV = "BASETRAINER_TRIAL"


def trial_overrides() -> Dict[str, Any]:
    """The keys a hyperparameter search sets for this run, which win over YAML and typed flags.

    A search (:mod:`basetrainer.tune`) runs the user's unchanged script once per trial; the only
    way into that process is its environment, so the search names a YAML file of overrides in
    ``BASETRAINER_TRIAL`` (the trial's parameters, its ``work_dir`` and a ``tune`` mapping that
    tells the trainer to add the reporting callback). Under NNI (``NNI_PLATFORM`` set by NNI's trial
    runner, or ``BASETRAINER_NNI=1`` for NNI's standalone mode) the parameters of
    ``nni.get_next_parameter()`` are the overrides and ``tune`` is ``"nni"``. From here on the
    context travels in the config, explicitly. Empty when neither is set.
    """
    path = os.environ.get(TRIAL_ENV)
    if path:
        return dict(load_config(path))
    if os.environ.get("NNI_PLATFORM") or os.environ.get("BASETRAINER_NNI") == "1":
        try:
            import nni
        except ImportError:
            raise MissingExtraError('this run is an NNI trial (NNI_PLATFORM or BASETRAINER_NNI is set) but nni is not '
                              'installed: pip install "basetrainer[nni]"') from None
        return {**dict(nni.get_next_parameter() or {}), "tune": "nni"}
    return {}


def print_dict(cfg: Any, title: str = "config") -> str:
    """The config as aligned ``key : value`` lines (returned and logged at INFO)."""
    items = vars(cfg) if isinstance(cfg, argparse.Namespace) else dict(cfg)
    width = max((len(str(k)) for k in items), default=0)
    text = "\n".join([f"{title}:"] + [f"  {str(k):<{width}} : {v}" for k, v in items.items()])
    logger.info("%s", text)
    return text


def key_table() -> List[Tuple[str, Any, str]]:
    """``(key, default, meaning)`` of every engine key (used for the README's table)."""
    return [(k, v[0], v[2]) for k, v in ENGINE_KEYS.items()]
