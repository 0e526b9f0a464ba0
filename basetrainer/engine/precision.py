"""Mixed precision: the autocast context of a step and the GradScaler of fp16."""
import contextlib
from typing import Any, Optional

import torch

from basetrainer.runtime.errors import ConfigError

AMP_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def check(amp: str, device: torch.device, accumulate_steps: Any) -> None:
    """Raise a clear error for a precision or accumulation setting that cannot work."""
    if amp not in AMP_DTYPES:
        raise ConfigError(f"amp={amp!r} is not a precision; choose from {sorted(AMP_DTYPES)}")
    if amp == "fp16" and device.type != "cuda":
        raise ConfigError("amp='fp16' needs a CUDA device (it uses a GradScaler); "
                          "on the CPU use amp='bf16' or amp='none'")
    if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
        raise ConfigError(f"accumulate_steps={accumulate_steps!r} must be an integer >= 1")


def make_scaler(amp: str) -> Optional[torch.amp.GradScaler]:
    """The GradScaler fp16 needs (None for the other precisions)."""
    return torch.amp.GradScaler("cuda") if amp == "fp16" else None


def autocast(amp: str, device: torch.device) -> Any:
    """The autocast context of a forward pass (a null context without mixed precision)."""
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
