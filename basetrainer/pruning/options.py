"""Validation of the arguments of :func:`basetrainer.pruning.nni_pruning.model_pruning`.

Everything here is plain Python: importing this module imports neither torch-pruning nor NNI,
so a bad argument is reported before any optional dependency is looked for.
"""
from typing import Dict, Sequence, Tuple, Union

from basetrainer.runtime.errors import ConfigError

#: The channel-ranking criteria, keyed by the (lower-case) name ``prune_type`` takes.
PRUNE_TYPES: Dict[str, str] = {
    "l1": "L1 norm of each output channel's weights (Li et al., 2017)",
    "l2": "L2 norm of each output channel's weights",
    "fpgm": "distance to the geometric median of the layer's filters (He et al., 2019)",
    "slim": "|BatchNorm scale| of each channel, network slimming (Liu et al., 2017)",
}

#: The names ``backend`` takes, each mapped to the backend it selects.
BACKENDS: Dict[str, str] = {
    "auto": "torch-pruning",
    "torch-pruning": "torch-pruning",
    "torch_pruning": "torch-pruning",
    "tp": "torch-pruning",
    "nni": "nni",
}

#: The pip command that installs each backend's package.
INSTALL_HINTS: Dict[str, str] = {
    "torch-pruning": 'pip install "basetrainer[prune]"',
    "nni": 'pip install "basetrainer[nni]"',
}

InputSize = Union[Sequence[int], Tuple[int, ...]]


def check_sparsity(sparsity: float) -> float:
    """Return ``sparsity`` as a float, or raise when it is not in the open interval (0, 1).

    Args:
        sparsity: Fraction of the output channels removed from every pruned layer.

    Returns:
        The same value as a ``float``.

    Raises:
        ValueError: ``sparsity`` is not a number strictly between 0 and 1.
    """
    try:
        value = float(sparsity)
    except (TypeError, ValueError):
        raise ConfigError(
            f"sparsity must be a number in the open interval (0, 1), got {sparsity!r}") from None
    if not 0.0 < value < 1.0:  # also rejects NaN
        raise ConfigError(
            f"sparsity must be in the open interval (0, 1), got {sparsity!r}; it is the fraction of "
            "output channels removed per layer, e.g. sparsity=0.5")
    return value


def check_prune_type(prune_type: str) -> str:
    """Return the registry key of ``prune_type`` (case-insensitive).

    Args:
        prune_type: One of :data:`PRUNE_TYPES` in any case, e.g. ``"L1"``.

    Returns:
        The lower-case key.

    Raises:
        ValueError: ``prune_type`` names no registered criterion.
    """
    key = prune_type.lower() if isinstance(prune_type, str) else prune_type
    if key not in PRUNE_TYPES:
        raise ConfigError(f"unknown prune_type {prune_type!r}; choose from {sorted(PRUNE_TYPES)}")
    return key


def check_backend(backend: str) -> str:
    """Return the canonical backend (``"torch-pruning"`` or ``"nni"``) that ``backend`` names.

    Args:
        backend: One of :data:`BACKENDS` in any case.

    Returns:
        ``"torch-pruning"`` or ``"nni"``.

    Raises:
        ValueError: ``backend`` is not a known name.
    """
    key = backend.lower() if isinstance(backend, str) else backend
    if key not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[key]


def parse_input_size(input_size: InputSize) -> Tuple[int, int, int, int]:
    """Turn ``input_size`` into the ``(N, C, H, W)`` shape of the example input.

    Two conventions are accepted: ``[W, H]`` (the config files' convention; 3 channels and a
    batch of 1 are assumed) and a full ``[N, C, H, W]`` shape.

    Args:
        input_size: ``[W, H]`` or ``[N, C, H, W]`` of positive integers.

    Returns:
        ``(N, C, H, W)``.

    Raises:
        ValueError: ``input_size`` has another length or a non-positive entry.
    """
    try:
        dims = [int(d) for d in input_size]
    except (TypeError, ValueError):
        raise ConfigError(
            f"input_size must be [W, H] or [N, C, H, W] of positive integers, got {input_size!r}"
        ) from None
    if len(dims) not in (2, 4) or any(d <= 0 for d in dims):
        raise ConfigError(
            f"input_size must be [W, H] or [N, C, H, W] of positive integers, got {input_size!r}; "
            "e.g. input_size=[224, 224] or input_size=[1, 3, 224, 224]")
    if len(dims) == 2:
        width, height = dims
        return 1, 3, height, width
    return dims[0], dims[1], dims[2], dims[3]
