"""The model to export: a module, or a file a training run wrote.

A module is looked through its wrappers (DataParallel, DDP, ``torch.compile``, an EMA wrapper
such as ``torch.optim.swa_utils.AveragedModel``, basetrainer's ``ModelEMA`` callback). A file
may be a weights file (``best_model_*.pth``, ``model_*.pth``: a state dict), a resumable
``last.pth`` (its config names the model), a sharded ``last.pth`` (its weights, or its EMA
average, read whole from its shard folder) or a pruned model's ``pruned_model.pth``.
A model trained after structural pruning has smaller layers than the dense model of its
``net_type``: they are rebuilt from the run's ``prune/pruned_model.pth`` (found from the config,
or given as ``pruned``).
"""
import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from basetrainer.runtime import checkpoint, sharding
from basetrainer.runtime.modules import unwrap_model

logger = logging.getLogger(__name__)

PRUNED_FORMAT = "basetrainer.pruned/1"


@dataclass
class ModelSource:
    """A model ready to export (eval mode, on the CPU) and what is known about it."""
    model: nn.Module
    description: str
    net_type: Optional[str] = None
    num_classes: Optional[int] = None
    input_size: Optional[List[int]] = None   # [W, H] it was trained at, when known
    pruned: Optional[str] = None             # the file its pruned layer shapes came from
    config: Dict[str, Any] = field(default_factory=dict)


def unwrap(model: Any) -> nn.Module:
    """The user's module inside training and averaging wrappers."""
    from basetrainer.callbacks.model_ema import ModelEMA

    if isinstance(model, ModelEMA):
        if not model.ema:   # basetrainer's ModelEMA callback: its average, in the trainer's model
            raise ValueError("the ModelEMA callback holds no average yet (training has not started); "
                             "export the trainer's model instead")
        inner = copy.deepcopy(unwrap(model.trainer.model))
        inner.load_state_dict({k: v.detach().cpu() for k, v in model.ema.items()})
        return inner
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module or a checkpoint path, got {type(model).__name__}")
    while True:
        model = unwrap_model(model)
        inner = getattr(model, "module", None)
        averaged = isinstance(model, torch.optim.swa_utils.AveragedModel) or "ema" in type(model).__name__.lower()
        if averaged and isinstance(inner, nn.Module):
            model = inner
            continue
        if sharding.is_fsdp(model):
            raise ValueError("the model is sharded (fully_shard): export it from its checkpoint instead "
                             "(python -m basetrainer.deploy <work_dir>/model/last.pth ...), which gathers it")
        return model


def _averaging(model: nn.Module) -> bool:
    """Whether ``model`` (inside its training wrappers) is an averaging wrapper (see :func:`unwrap`)."""
    model = unwrap_model(model)
    averaged = isinstance(model, torch.optim.swa_utils.AveragedModel) or "ema" in type(model).__name__.lower()
    return averaged and isinstance(getattr(model, "module", None), nn.Module)


def load_model(source: Union[str, nn.Module, Any], net_type: Optional[str] = None,
               num_classes: Optional[int] = None, input_size: Optional[List[int]] = None,
               pruned: Optional[str] = None, weights: str = "model") -> ModelSource:
    """The model of ``source``, on the CPU in eval mode.

    Args:
        source: a module (wrappers looked through) or the path of a file a run wrote.
        net_type, num_classes, input_size: the model's ``get_models`` arguments; needed for a
            weights file (a resumable ``last.pth`` names them in its config; a
            ``setup_config.yaml`` beside the run's ``model/`` folder is read when present;
            ``num_classes`` is read from the weights otherwise). Given ones win.
        pruned: the ``pruned_model.pth`` (or its folder) whose layer shapes the weights have.
        weights: ``"model"`` or ``"ema"`` (the ModelEMA average inside a resumable checkpoint,
            a sharded one too; for a module source, only with the ModelEMA callback or an
            averaging wrapper, whose average is taken either way).

    Raises:
        FileNotFoundError: no such file. ValueError: the file holds no weights, the weights do
        not fit ``net_type``, or what the model is cannot be told (the message names the flag).
    """
    if weights not in ("model", "ema"):
        raise ValueError(f"weights={weights!r} must be 'model' or 'ema'")
    if not isinstance(source, (str, os.PathLike)):
        if weights == "ema" and isinstance(source, nn.Module) and not _averaging(source):
            raise ValueError(f"weights='ema' picks ModelEMA's average from a checkpoint file, and the source is a "
                             f"{type(source).__name__} module: pass the ModelEMA callback itself (its average is "
                             f"exported) or the run's last.pth, or weights='model'")
        model = copy.deepcopy(unwrap(source)).cpu().eval()
        return ModelSource(model, f"{type(model).__name__} module", net_type, num_classes)   # trained size unknown
    path = os.fspath(source)
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a folder; pass a file: a weights file (best_model_*.pth), last.pth or "
                         f"pruned_model.pth")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; pass the path of a weights file or "
                                f"last.pth (e.g. work_space/digits/model/last.pth)")
    obj = checkpoint.load_file(path)
    config = _config_of(obj, path)
    if isinstance(obj, dict) and obj.get("format") == PRUNED_FORMAT:
        if weights == "ema":
            raise ValueError(f"{path!r} is a pruned model's file and holds no ModelEMA average (weights='ema' needs "
                             f"a resumable last.pth of a run trained with the ModelEMA callback); use weights='model'")
        pruned, state = path, obj["state_dict"]
        logger.info("%s is a pruned model's file: its weights are the ones right after pruning", path)
    else:
        state = _weights(obj, path, weights)
    net_type = net_type or config.get("net_type")
    size = list(input_size) if input_size else config.get("input_size")
    if not net_type:
        raise ValueError(f"{path!r} holds weights only and names no model: pass net_type (--net-type resnet18) "
                         f"and the input size it was trained at (--input-size W H)")
    if not size:
        raise ValueError(f"the input size of {path!r} is unknown: pass it (--input-size W H, e.g. 32 32)")
    num_classes = num_classes or config.get("num_classes") or _classes_in(state, net_type, size)
    model = _build(net_type, size, num_classes)
    pruned = pruned or (_pruned_file_for(path, config) if _shapes_differ(model, state) else None)
    if pruned:
        pruned = _reshape(model, pruned)
    _load(model, state, path, net_type, pruned)
    return ModelSource(model.eval(), f"{os.path.basename(path)} ({net_type}, {num_classes} classes)", net_type,
                       num_classes, list(size), pruned, config)


def _config_of(obj: Any, path: str) -> Dict[str, Any]:
    """The training config: inside a resumable checkpoint, else the run's setup_config.yaml."""
    if isinstance(obj, dict) and isinstance(obj.get("config"), dict) and obj["config"]:
        return dict(obj["config"])
    folder = os.path.dirname(os.path.abspath(path))
    for candidate in (os.path.join(folder, "setup_config.yaml"), os.path.join(os.path.dirname(folder), "setup_config.yaml")):
        if os.path.isfile(candidate):
            import yaml

            with open(candidate, encoding="utf-8") as f:
                found = yaml.safe_load(f) or {}
            if isinstance(found, dict):
                logger.info("model settings from %s", candidate)
                return found
    return {}


def _weights(obj: Any, path: str, which: str) -> Dict[str, torch.Tensor]:
    """The model's weights (``which="model"``) or ModelEMA's average (``"ema"``) in the loaded
    file ``obj``. A sharded ``last.pth`` holds pointers (``"dcp:<key>"``) where its tensors
    were, for the average as for the weights: those are read whole from its shard folder."""
    part = _ema_state(obj, path) if which == "ema" else obj
    if isinstance(obj, dict) and obj.get("shards"):
        from basetrainer.runtime import sharded

        part = part.get("model") if which == "model" and isinstance(part, dict) else part
        folder = os.path.dirname(os.path.abspath(path))
        part = sharded.load({"shards": obj["shards"], "part": part}, folder, mesh=None)["part"]
    return checkpoint.extract_state_dict(part, source=f"checkpoint {path!r}")


def _ema_state(obj: Any, path: str) -> Dict[str, Any]:
    """The ModelEMA average in the loaded checkpoint ``obj``: the only one, or, of several, the
    one that evaluated (the test figures and the weights files are of it)."""
    states = obj.get("callbacks", {}) if isinstance(obj, dict) else {}
    found = [s for s in states.values() if isinstance(s, dict) and "decay" in s and s.get("ema")]
    if not found:
        raise ValueError(f"{path!r} holds no ModelEMA average (weights='ema' needs a resumable last.pth of a run "
                         f"trained with the ModelEMA callback); use weights='model'")
    evaluated = [s for s in found if s.get("evaluate")]
    if len(found) > 1 and len(evaluated) != 1:
        decays = ", ".join(str(s["decay"]) for s in found)
        raise ValueError(f"{path!r} holds {len(found)} ModelEMA averages (decay {decays}), none saved as the one "
                         f"that evaluated: weights='ema' cannot tell which to export. Export a weights file of the run "
                         f"(best_model_*.pth holds the weights its figure was tested on), or use weights='model'")
    return dict((evaluated or found)[0]["ema"])


def _build(net_type: str, size: List[int], num_classes: int) -> nn.Module:
    from basetrainer.models.build_models import get_models

    return get_models(net_type, list(size), int(num_classes), pretrained=False)


def _classes_in(state: Dict[str, torch.Tensor], net_type: str, size: List[int]) -> int:
    probe = _build(net_type, size, 2)
    heads = [name for name, m in probe.named_modules() if isinstance(m, nn.Linear)]
    weight = state.get(f"{heads[-1]}.weight") if heads else None
    if weight is None or weight.dim() != 2:
        raise ValueError(f"cannot tell the number of classes from the weights (no {heads[-1] if heads else 'head'}"
                         f".weight of a {net_type}); pass num_classes (--num-classes N)")
    return int(weight.shape[0])


def _shapes_differ(model: nn.Module, state: Dict[str, torch.Tensor]) -> bool:
    own = model.state_dict()
    return any(k in own and own[k].shape != v.shape for k, v in state.items())


def _pruned_file_for(path: str, config: Dict[str, Any]) -> Optional[str]:
    """The run's pruned_model.pth: under the config's work_dir, or beside the model folder."""
    folder = os.path.dirname(os.path.abspath(path))
    candidates = [os.path.join(os.path.dirname(folder), "prune", "pruned_model.pth")]
    if config.get("work_dir"):
        candidates.insert(0, os.path.join(str(config["work_dir"]), "prune", "pruned_model.pth"))
    return next((c for c in candidates if os.path.isfile(c)), None)


def _reshape(model: nn.Module, pruned: str) -> str:
    from basetrainer.pruning.shapes import reshape_to

    file = os.path.join(pruned, "pruned_model.pth") if os.path.isdir(pruned) else pruned
    payload = checkpoint.load_file(file)
    if not isinstance(payload, dict) or payload.get("format") != PRUNED_FORMAT:
        raise ValueError(f"pruned={file!r} is not a pruned model's file (format {PRUNED_FORMAT!r}); pass the "
                         f"run's <work_dir>/prune/pruned_model.pth")
    replaced = reshape_to(model, payload["shapes"])
    logger.info("rebuilt %d pruned layers from %s", len(replaced), file)
    return file


def _load(model: nn.Module, state: Dict[str, torch.Tensor], path: str, net_type: str, pruned: Optional[str]) -> None:
    from basetrainer.utils.torch_tools import load_weights

    try:
        load_weights(model, state, strict=True, source=path)
    except ValueError as e:
        hint = ("" if pruned else "; if the model was pruned before training, pass its pruned_model.pth "
                                  "(--pruned <work_dir>/prune/pruned_model.pth)")
        raise ValueError(f"{e}. Pass the net_type and num_classes of the run that wrote it "
                         f"(--net-type, --num-classes; now {net_type!r}){hint}") from None
