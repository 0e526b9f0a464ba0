"""``convert2ncnn``: the original's PyTorch -> NCNN (pnnx) entry point (see :mod:`basetrainer.deploy`)."""
import os
from typing import Any, Sequence

from basetrainer.utils.converter.pytorch2onnx import prune_for_export


def convert2ncnn(model: Any, input_shape: Sequence[int], input_names: Sequence[str] = ("input",),
                 output_names: Sequence[str] = ("output",), out_file: str = "", fp16: bool = True,
                 use_prune: bool = False, sparsity: float = 0.2, device: str = "cpu", check: Any = None) -> str:
    """Convert ``model`` with pnnx to ``<name>.ncnn.param`` / ``.bin`` in the folder of
    ``out_file`` (default ``./output/model``) and return that folder, as the original did.

    ``fp16`` stores the weights in fp16 and the check then runs NCNN with fp16 storage (the fp16
    bound); ``fp16=False`` gives an fp32 model checked within 1e-4. ``input_names`` and
    ``output_names`` are accepted for the original's signature (pnnx names them in0/out0).
    """
    from basetrainer.deploy.export import export_model

    out_file = out_file or os.path.join("output", "model.jit")
    folder = os.path.dirname(os.path.abspath(out_file))
    name = os.path.basename(out_file).split(".")[0] or "model"
    if use_prune:
        from basetrainer.deploy.source import unwrap

        model = prune_for_export(unwrap(model), input_shape, folder, sparsity, device)
    export_model(model, "ncnn-fp16" if fp16 else "ncnn", out_dir=folder, check=check, runs=0, name=name,
                 input_size=[int(input_shape[3]), int(input_shape[2])], report_files=False)
    return folder
