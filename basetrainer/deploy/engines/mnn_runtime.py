"""MNN: :class:`MNNEngine`, the original's engine with its keywords.

``quant=0`` runs in fp32 and says so twice: precision ``high``, and no Winograd convolution
(MNN's default 3x3 Winograd kernels move resnet18's logits by about 1e-4 even in fp32; without
them MNN agrees with eager PyTorch within about 2e-6). ``quant=1`` asks for precision ``low``
(fp16 where the CPU has it).
"""
import logging
import os
import tempfile
from typing import Any, List, Optional

import numpy as np

from basetrainer.deploy.converters import write_mnn
from basetrainer.deploy.engines.base import InferenceEngine, check_quant, fall_back_to_cpu
from basetrainer.deploy.runtimes import quiet_stdout, require

logger = logging.getLogger(__name__)

WINOGRAD_MEMORY_LEVEL = 3   # MNN's Interpreter::HintMode; 0 turns the Winograd kernels off


class MNNEngine(InferenceEngine):
    """Run an MNN model (an ``.onnx`` file is converted to ``.mnn`` first, in a temp folder).

    Args:
        model_file: the ``.mnn`` (or ``.onnx``) file.
        quant: 0 fp32 (precision high, no Winograd), 1 fp16 (precision low).
        simplify: simplify an ``.onnx`` model with onnxslim before converting it.
        dynamic: the model takes any batch.
        num_thread: MNN's CPU threads.
        device: MNN's backend: ``"cpu"``, ``"cuda"``, ``"opencl"``, ``"vulkan"``.
        use_gpu: accepted like the other engines; MNN's GPU is chosen by ``device``.
        device_id: accepted like the other engines (see ``device``).
    """

    name = "mnn"

    def __init__(self, model_file: str, quant: int = 0, simplify: bool = False, dynamic: bool = True,
                 num_thread: int = 4, device: str = "cpu", use_gpu: bool = False, device_id: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(check_quant(quant, "MNNEngine", supported=(0, 1)), dynamic)
        if kwargs:
            logger.warning("MNNEngine ignores the keywords %s", sorted(kwargs))
        mnn = require("MNN")
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"MNN model file {model_file!r} does not exist; export it first "
                                    f"(python -m basetrainer.deploy CHECKPOINT --format mnn)")
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        if model_file.endswith(".onnx"):
            model_file = self._convert(model_file, simplify)
        self.device = str(device).upper()
        if use_gpu and self.device == "CPU":
            fall_back_to_cpu("MNNEngine", "device='cpu' (MNN's GPU backends: device='cuda', 'opencl' or 'vulkan')")
        self.config = {"backend": self.device, "precision": "high" if self.quant == 0 else "low",
                       "numThread": int(num_thread), "memory": "normal"}
        with quiet_stdout("MNN"):
            runtime = mnn.nn.create_runtime_manager((self.config,))
            if self.quant == 0:
                runtime.set_hint(WINOGRAD_MEMORY_LEVEL, 0)
            self.inp_names, self.out_names, shape = self.get_node_names(model_file)
            self.model = mnn.nn.load_module_from_file(model_file, self.inp_names, self.out_names,
                                                      shape_mutable=self.dynamic, runtime_manager=runtime)
        self.input_shape = tuple(shape[1:]) if len(shape) >= 2 else None
        self._mnn = mnn
        logger.info("MNNEngine: %s on %s, %s, inputs %s -> outputs %s", model_file, self.device,
                    "fp32" if self.quant == 0 else "fp16", self.inp_names, self.out_names)

    def _convert(self, onnx_file: str, simplify: bool) -> str:
        self._tmp = tempfile.TemporaryDirectory(prefix="basetrainer-mnn-")
        if simplify:
            onnx = require("onnx")
            from basetrainer.deploy.onnx_format import simplify_proto

            simple = os.path.join(self._tmp.name, "model.onnx")
            onnx.save(simplify_proto(onnx.load(onnx_file)), simple)
            onnx_file = simple
        return write_mnn(onnx_file, os.path.join(self._tmp.name, "model.mnn"), fp16=self.quant == 1)

    @staticmethod
    def get_node_names(mnn_file: str) -> tuple:
        """``(input names, output names, input shape)`` of an ``.mnn`` file, the names in the
        model's order (the converter stores the ONNX graph's; the interpreter's session lists
        them sorted by name, which would hand the outputs back in another order)."""
        mnn = require("MNN")
        with quiet_stdout("MNN"):
            info = mnn.nn.load_module_from_file(mnn_file, [], []).get_info()
            interpreter = mnn.Interpreter(mnn_file)
            shape = list(interpreter.getSessionInput(interpreter.createSession()).getShape())
        return list(info["inputNames"]), list(info["outputNames"]), shape

    def _run(self, batch: np.ndarray) -> List[np.ndarray]:
        expr = self._mnn.expr
        var = expr.const(batch, list(batch.shape), expr.NCHW, expr.float)
        results = []
        for out in self.model.onForward([var]):
            if out.data_format == expr.NC4HW4:
                out = expr.convert(out, expr.NCHW)
            results.append(np.array(out.read(), dtype=np.float32, copy=True))
        return results
