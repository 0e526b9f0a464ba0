"""NCNN: :class:`NCNNEngine`, the original's engine with its keywords.

NCNN stores and computes in fp16 by default where it can (``opt.use_fp16_storage``, ``_packed``,
``_arithmetic``, and bf16 storage). ``quant=0`` turns all of them off, so the model runs in fp32
(resnet18 on 32x32 digits: 2e-6 from eager PyTorch instead of 3e-4). NCNN runs one sample at a
time; a batch is fed sample by sample and the outputs are stacked.
"""
import logging
import os
from typing import Any, List, Optional

import numpy as np

from basetrainer.deploy.engines.base import InferenceEngine, check_quant, fall_back_to_cpu
from basetrainer.deploy.runtimes import require

logger = logging.getLogger(__name__)


class NCNNEngine(InferenceEngine):
    """Run an NCNN model (``.param`` + ``.bin``, as pnnx writes them).

    Args:
        par_file: the ``.param`` file (also accepted as ``model_file``).
        bin_file: the ``.bin`` file (default: beside ``par_file``).
        num_thread: CPU threads (``None``/``-1``: one per core).
        use_gpu: run on a Vulkan GPU when ncnn sees one (else a warning, and the CPU).
        use_fp16: fp16 storage and arithmetic; ``None`` (the default) follows ``quant``.
        quant: 0 fp32 (every fp16/bf16 option off), 1 fp16.
        device_id: the Vulkan GPU.
        simplify: accepted like the other engines.
        dynamic: accepted like the other engines (NCNN takes any batch, sample by sample).
    """

    name = "ncnn"
    batched = False

    def __init__(self, par_file: Optional[str] = None, bin_file: str = "", num_thread: Optional[int] = None,
                 use_gpu: bool = False, use_fp16: Optional[bool] = None, *, model_file: Optional[str] = None,
                 quant: int = 0, simplify: bool = False, dynamic: bool = True, device_id: int = 0,
                 **kwargs: Any) -> None:
        quant = check_quant(quant, "NCNNEngine", supported=(0, 1))
        fp16 = bool(quant == 1) if use_fp16 is None else bool(use_fp16)
        super().__init__(1 if fp16 else 0, dynamic)
        if kwargs:
            logger.warning("NCNNEngine ignores the keywords %s", sorted(kwargs))
        ncnn = require("ncnn")
        par_file = par_file or model_file
        if not par_file:
            raise ValueError("NCNNEngine needs the model's .param file: NCNNEngine('model.param')")
        bin_file = bin_file or os.path.splitext(par_file)[0] + ".bin"
        for kind, path in (("param", par_file), ("bin", bin_file)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"NCNN .{kind} file {path!r} does not exist; export the model first "
                                        f"(python -m basetrainer.deploy CHECKPOINT --format ncnn)")
        self.net = ncnn.Net()
        opt = self.net.opt
        opt.num_threads = int(num_thread) if num_thread and num_thread > 0 else ncnn.get_cpu_count()
        for flag in ("use_fp16_storage", "use_fp16_packed", "use_fp16_arithmetic", "use_bf16_storage"):
            setattr(opt, flag, fp16 and flag != "use_bf16_storage")
        self.device = "cpu"
        if use_gpu:
            if ncnn.get_gpu_count() > 0:
                opt.use_vulkan_compute = True
                self.net.set_vulkan_device(int(device_id))
                self.device = f"vulkan:{device_id}"
            else:
                fall_back_to_cpu("NCNNEngine", "ncnn sees no Vulkan GPU")
        if self.net.load_param(par_file) != 0 or self.net.load_model(bin_file) != 0:
            raise ValueError(f"ncnn cannot load {par_file!r} / {bin_file!r} (damaged or not an NCNN model); "
                             f"export it again")
        self.inp_names = list(self.net.input_names())
        self.out_names = list(self.net.output_names())
        self._ncnn = ncnn
        logger.info("NCNNEngine: %s on %s, %s, %d threads, inputs %s -> outputs %s", par_file, self.device,
                    "fp16" if fp16 else "fp32", opt.num_threads, self.inp_names, self.out_names)

    def _run(self, batch: np.ndarray) -> List[np.ndarray]:
        outputs: List[np.ndarray] = []
        with self.net.create_extractor() as ex:
            ex.input(self.inp_names[0], self._ncnn.Mat(np.ascontiguousarray(batch[0])))
            for name in self.out_names:
                ret, out = ex.extract(name)
                if ret != 0:
                    raise RuntimeError(f"ncnn could not compute output {name!r} (error {ret}) for an input of shape "
                                       f"{tuple(batch.shape)}; check the input size")
                outputs.append(np.array(out, dtype=np.float32, copy=True)[None])
        return outputs
