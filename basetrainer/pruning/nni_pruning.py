"""Structured pruning that really shrinks the model: :func:`model_pruning`.

Output channels are removed from convolutions (and the BatchNorm / next layers that depend on
them), so the pruned model has fewer parameters and MACs and runs faster on any hardware; no
masks are left behind. Channels are ranked by ``prune_type``:

========  ===================================================================
``l1``    L1 norm of each output channel's weights
``l2``    L2 norm of each output channel's weights
``fpgm``  distance to the geometric median of the layer's filters
``slim``  ``|BatchNorm scale|`` (train with :class:`~basetrainer.pruning.slim.SlimRegularizer`)
========  ===================================================================

Backends: ``"torch-pruning"`` (the default; ``pip install "basetrainer[prune]"``) and ``"nni"``
(NNI 3.0 chooses the channels, torch-pruning removes them; ``pip install "basetrainer[nni]"``).
Neither package is imported until :func:`model_pruning` prunes.

Example::

    from basetrainer.pruning.nni_pruning import model_pruning

    model = model_pruning(model, input_size=[224, 224], sparsity=0.5, prune_type="l1",
                          output_prune="work_space/pruning")
    # later, or on the other ranks of a distributed run, rebuild it without pruning again:
    model = model_pruning(build_dense_model(), [224, 224], reuse=True,
                          output_prune="work_space/pruning")
"""
import logging
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from basetrainer.runtime import comm
from basetrainer.pruning import options, structural
from basetrainer.pruning.checkpoint import load_pruned, pruned_path, read_pruned, save_pruned
from basetrainer.pruning.counter import profile_model
from basetrainer.pruning.nni_masks import MaskImportance, import_nni_pruning, nni_channel_masks
from basetrainer.pruning.options import BACKENDS, PRUNE_TYPES, InputSize  # noqa: F401 (re-export)
from basetrainer.pruning.report import build_report, summary_line, write_report
from basetrainer.pruning.shapes import layer_shapes

__all__ = ["model_pruning", "PRUNE_TYPES", "BACKENDS"]

logger = logging.getLogger(__name__)

_EXTRA_KWARGS = ("round_to",)


def model_pruning(model: nn.Module, input_size: InputSize, sparsity: float = 0.5,
                  reuse: bool = False, output_prune: str = "pruning_output", prune_type: str = "l1",
                  backend: str = "auto", ignored_layers: Optional[Iterable[Union[str, nn.Module]]] = None,
                  device: Union[str, torch.device] = "cpu", **kwargs: Any) -> nn.Module:
    """Prune ``sparsity`` of the output channels of every prunable layer, structurally.

    The model is modified in place and returned (on ``device``) with thinner layers, the same
    input and the same outputs. Its classifier head (the last ``nn.Linear`` the forward pass
    runs, or the last convolution if there is none) and every layer in ``ignored_layers`` keep
    their output channels; their input channels follow the layers that feed them. Channels that
    must stay equal (the branches of a residual sum, a depthwise convolution and its input) are
    pruned together.

    Two files are written in ``output_prune``: ``pruned_model.pth`` (weights plus the layer shapes
    needed to rebuild the model; loads with ``torch.load(path, weights_only=True)``) and the report
    ``prune_report.json`` / ``prune_report.txt`` (parameters and MACs before and after, channels
    of every layer). A one-line summary is logged.

    Args:
        model: The dense model (not wrapped in DataParallel/DDP).
        input_size: ``[W, H]`` (3 channels and a batch of 1 assumed) or ``[N, C, H, W]``.
        sparsity: Fraction of output channels removed per pruned layer, in (0, 1); 0.5 leaves
            about a quarter of a convolution's weights.
        reuse: Do not prune: reshape ``model`` to the file in ``output_prune`` and load its
            weights. In a distributed run with ``reuse=False``, rank 0 prunes and the other
            ranks do this after a barrier, so every rank holds the same pruned model.
        output_prune: Folder for the pruned file and the report (created).
        prune_type: ``"l1"``, ``"l2"``, ``"fpgm"`` or ``"slim"``, in any case.
        backend: ``"auto"`` (= ``"torch-pruning"``), ``"torch-pruning"`` (or ``"torch_pruning"``,
            ``"tp"``) or ``"nni"``.
        ignored_layers: Modules of ``model``, or their qualified names, whose output channels are
            never pruned (a container, e.g. ``"layer4"``, protects everything inside it).
        device: Device to prune on and to return the model on.
        **kwargs: ``round_to`` (int): keep a multiple of this many channels per layer
            (torch-pruning rounds the kept count down). Other keyword arguments are ignored with
            a warning.

    Returns:
        The pruned model (the same object as ``model``), in the train/eval mode it came in.

    Raises:
        ValueError: A bad ``sparsity``, ``prune_type``, ``backend``, ``input_size`` or
            ``ignored_layers``; or ``reuse=True`` with a file made from another architecture.
        ImportError: The backend's package is missing (the message gives the pip command).
        FileNotFoundError: ``reuse=True`` but ``output_prune`` holds no pruned file.
    """
    sparsity = options.check_sparsity(sparsity)
    method = options.check_prune_type(prune_type)
    engine = options.check_backend(backend)
    shape = options.parse_input_size(input_size)
    if engine == "nni" and method == "slim":
        raise ValueError("prune_type='slim' is not available with backend='nni' (NNI's "
                         "SlimPruner needs its own training loop); use backend='torch-pruning' "
                         "with prune_type='slim', after training with SlimRegularizer")
    unknown = sorted(set(kwargs) - set(_EXTRA_KWARGS))
    if unknown:
        logger.warning("model_pruning ignores the keyword arguments %s (accepted: %s)",
                       unknown, list(_EXTRA_KWARGS))
    round_to = kwargs.get("round_to")
    if round_to is not None and (isinstance(round_to, bool) or not isinstance(round_to, int)
                                 or round_to < 1):
        raise ValueError(f"round_to must be a positive int or None, got {round_to!r}; e.g. round_to=8")
    settings = {"prune_type": method, "sparsity": sparsity, "backend": engine,
                "input_shape": list(shape), "model": type(model).__name__}
    if reuse:
        return _reuse(model, output_prune, settings, device)
    if comm.get_world_size() > 1:  # DDP: rank 0 prunes, the other ranks load what it wrote
        if comm.is_main_process():
            model = _prune(model, output_prune, settings, ignored_layers, device, round_to)
        comm.synchronize()
        return model if comm.is_main_process() else _reuse(model, output_prune, settings, device)
    return _prune(model, output_prune, settings, ignored_layers, device, round_to)


def _reuse(model: nn.Module, directory: str, settings: dict, device: Union[str, torch.device]
           ) -> nn.Module:
    payload = read_pruned(directory)
    saved = payload.get("meta", {}).get("settings", {})
    differs = {k: (saved.get(k), settings[k]) for k in ("prune_type", "sparsity", "model")
               if k in saved and saved[k] != settings[k]}
    if differs:
        logger.warning("reusing %s, made with other settings than requested (saved, requested): "
                       "%s", pruned_path(directory), differs)
    replaced = load_pruned(model, payload)
    logger.info("loaded the pruned model from %s: %d layers reshaped",
                pruned_path(directory), len(replaced))
    return model.to(device)


def _prune(model: nn.Module, directory: str, settings: dict,
           ignored_layers: Optional[Iterable[Union[str, nn.Module]]],
           device: Union[str, torch.device], round_to: Optional[int]) -> nn.Module:
    method, engine = settings["prune_type"], settings["backend"]
    if engine == "nni":
        import_nni_pruning()  # fail before any work when NNI is missing
    structural.import_torch_pruning()

    model = model.to(device)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    example = torch.randn(*settings["input_shape"], device=device, dtype=dtype)
    ignored = structural.resolve_ignored(model, ignored_layers)
    head = structural.find_head(model, example)
    if head is not None:
        ignored.append(head)
    shapes_before = layer_shapes(model)
    cost_before = profile_model(model, example)
    outputs_before = structural.output_shapes(model, example)

    if engine == "nni":
        masks = nni_channel_masks(model, settings["sparsity"], method, exclude=ignored)
        importance = MaskImportance(masks, model)
    else:
        importance = structural.make_importance(method)
    structural.prune_channels(model, example, importance, settings["sparsity"], ignored,
                              round_to=round_to)

    outputs_after = structural.output_shapes(model, example)
    if outputs_after != outputs_before:
        raise RuntimeError(f"pruning changed the model's outputs from {outputs_before} to "
                           f"{outputs_after}; pass the layers that produce the outputs in "
                           "ignored_layers")
    cost_after = profile_model(model, example)
    report = build_report(cost_before, cost_after, shapes_before, layer_shapes(model), settings)
    path = save_pruned(model, directory, {"settings": settings, "params": cost_after.params,
                                          "macs": cost_after.macs,
                                          "torch_version": str(torch.__version__)})
    write_report(report, directory)
    logger.info("pruned %s (%s, %s, sparsity %.2f): %s; saved to %s", settings["model"], method,
                engine, settings["sparsity"], summary_line(report), path)
    return model
