"""OpenVINO: :class:`OpenVINOEngine` (new; the original had none), with the engines' keywords.

OpenVINO picks its inference precision by itself: on a CPU with bf16 (AMX, AVX512-BF16) its
default is bf16 (resnet18: 8e-3 from eager PyTorch). ``quant=0`` sets
``INFERENCE_PRECISION_HINT: f32`` (9e-7); ``quant=1`` asks for f16, which a CPU without fp16
arithmetic runs in f32 (the precision in use is logged). Int8 needs NNCF and is not offered.
"""
import logging
import os
from typing import Any, List, Optional

import numpy as np

from basetrainer.deploy.engines.base import InferenceEngine, check_quant, fall_back_to_cpu
from basetrainer.deploy.runtimes import require
from basetrainer.deploy.signal_stack import kept_signal_stack

logger = logging.getLogger(__name__)


class OpenVINOEngine(InferenceEngine):
    """Run an OpenVINO IR (``.xml`` + ``.bin``) or an ``.onnx`` file with OpenVINO.

    Args:
        model_file: the ``.xml`` (its ``.bin`` beside it) or ``.onnx`` file.
        use_gpu: run on OpenVINO's ``GPU`` device when there is one (else a warning, and the CPU).
        quant: 0 fp32, 1 fp16 (where the device has it).
        simplify: accepted like the other engines (OpenVINO optimises the graph itself).
        dynamic: the model takes any batch.
        device_id: the GPU (``GPU.<device_id>``).
        num_thread: OpenVINO's inference threads (``None``: its default).
    """

    name = "openvino"

    def __init__(self, model_file: str, use_gpu: bool = False, quant: int = 0, simplify: bool = False,
                 dynamic: bool = True, device_id: int = 0, num_thread: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(check_quant(quant, "OpenVINOEngine", supported=(0, 1)), dynamic)
        if kwargs:
            logger.warning("OpenVINOEngine ignores the keywords %s", sorted(kwargs))
        ov = require("openvino")
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"OpenVINO model file {model_file!r} does not exist; export it first "
                                    f"(python -m basetrainer.deploy CHECKPOINT --format openvino)")
        core = ov.Core()
        self.device = "CPU"
        if use_gpu:
            gpus = [d for d in core.available_devices if d.startswith("GPU")]
            if gpus:
                self.device = f"GPU.{device_id}" if len(gpus) > 1 else "GPU"
            else:
                fall_back_to_cpu("OpenVINOEngine", f"OpenVINO sees no GPU (devices: {core.available_devices})")
        config: dict = {"INFERENCE_PRECISION_HINT": "f32" if self.quant == 0 else "f16"}
        if num_thread:
            config["INFERENCE_NUM_THREADS"] = int(num_thread)
        try:
            with kept_signal_stack():   # OpenVINO swaps the thread's signal stack (see deploy.signal_stack)
                model = core.read_model(model_file)
                self.compiled = core.compile_model(model, self.device, config)
        except Exception as e:
            raise ValueError(f"OpenVINO cannot load {model_file!r} ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); export it again") from e
        self.request = self.compiled.create_infer_request()
        self.inp_names = [next(iter(i.get_names()), str(k)) for k, i in enumerate(self.compiled.inputs)]
        self.out_names = [next(iter(o.get_names()), str(k)) for k, o in enumerate(self.compiled.outputs)]
        shape = self.compiled.inputs[0].get_partial_shape()
        if shape.rank.is_static and shape.rank.get_length() == 4:
            self.input_shape = tuple(d.get_length() if d.is_static else None for d in list(shape)[1:])
            if shape[0].is_static and shape[0].get_length() == 1:
                self.dynamic = False
        self.precision = str(self.compiled.get_property("INFERENCE_PRECISION_HINT"))
        logger.info("OpenVINOEngine: %s on %s, inference precision %s, inputs %s -> outputs %s", model_file,
                    self.device, self.precision, self.inp_names, self.out_names)

    def _run(self, batch: np.ndarray) -> List[np.ndarray]:
        results = self.request.infer({0: batch})
        # the request reuses its output buffers: copy them before the next call
        return [np.array(results[out], dtype=np.float32, copy=True) for out in self.compiled.outputs]
