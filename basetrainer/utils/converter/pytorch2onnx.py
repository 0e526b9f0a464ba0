"""``convert2onnx``: the original's PyTorch -> ONNX entry point (see :mod:`basetrainer.deploy`)."""
import os
from typing import Any, Optional, Sequence

from torch import nn


def prune_for_export(model: nn.Module, input_shape: Sequence[int], folder: str, sparsity: float,
                     device: str) -> nn.Module:
    """The original's ``use_prune``: prune ``sparsity`` of the channels (torch-pruning) before
    exporting; the pruned model's file and report go to ``<folder>/prune``."""
    from basetrainer.pruning import nni_pruning

    _, _, h, w = input_shape
    return nni_pruning.model_pruning(model, input_size=[w, h], sparsity=sparsity, reuse=False,
                                     output_prune=os.path.join(folder, "prune"), device=device)


def convert2onnx(model: Any, input_shape: Sequence[int], input_names: Sequence[str] = ("input",),
                 output_names: Sequence[str] = ("output",), onnx_file: str = "", dynamic: bool = True,
                 simplify: bool = True, opset_version: Optional[int] = 11, use_prune: bool = False,
                 sparsity: float = 0.2, device: str = "cpu", check: Any = None, exporter: str = "auto") -> str:
    """Export ``model`` to ``onnx_file`` (default ``./output/model.onnx``) and return its path.

    Args:
        model: a module (DDP/DP/compile/EMA wrappers are looked through) or a checkpoint file.
        input_shape: ``(B, C, H, W)``.
        input_names: the graph's input names.
        output_names: the graph's output names.
        onnx_file: the file to write (atomically; the simplified graph is written there too,
            not to a second ``_sim.onnx`` as the original did).
        dynamic: dynamic batch axis (``False``: a fixed batch of 1).
        simplify: simplify the graph with onnxslim.
        opset_version: ONNX opset; below 18 torch's TorchScript exporter writes it, from 18 (or
            ``None``) the dynamo exporter.
        use_prune: prune the model first (structural, torch-pruning).
        sparsity: the pruning's sparsity (with ``use_prune``).
        device: where pruning runs (the export itself runs on the CPU).
        check: images ``(N, C, H, W)`` or an ImageFolder the export is checked on against the
            model (default: random inputs); beyond 1e-4 it is an error and no file is written.
        exporter: ``"auto"``, ``"dynamo"`` or ``"torchscript"``.
    """
    from basetrainer.deploy.export import export_model

    onnx_file = onnx_file or os.path.join("output", "model.onnx")
    folder = os.path.dirname(os.path.abspath(onnx_file))
    if use_prune:
        from basetrainer.deploy.source import unwrap

        model = prune_for_export(unwrap(model), input_shape, folder, sparsity, device)
    name = os.path.splitext(os.path.basename(onnx_file))[0]
    export_model(model, "onnx", out_dir=folder, input_size=[int(input_shape[3]), int(input_shape[2])], check=check,
                 simplify=simplify, exporter=exporter, opset=opset_version, runs=0, name=name, dynamic=dynamic,
                 input_names=input_names, output_names=output_names, report_files=False)
    return os.path.join(folder, f"{name}.onnx")
