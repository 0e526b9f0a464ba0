"""What an export feeds the model: one image input ``(N, C, H, W)`` (or one input of the shape the
user gives, :func:`sample_shape`), checked before any file is written.

- One input: a ``forward`` that needs more than the image is refused (:func:`check_one_input`).
- The channels ``C``: those with which the layer the image reaches first in a forward pass (a
  probe that stops there, :func:`first_layer`) gets the channels it takes; not those of the first
  convolution registered, which may sit anywhere in the forward (a head registered first, a stem
  after its blocks), and not always that layer's own (a grayscale image repeated to RGB before
  it). Given ones are checked the same way; with no convolution on the image's way, 3 is a
  guess, and a forward pass that fails then names the option.
- The size ``W x H``: the one given, else the one the run trained at.
"""
import inspect
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

CHANNELS_GUESS = 3   # RGB: the channels assumed when no convolution takes the image


class _Reached(Exception):
    """Raised by the probe's hook to stop the forward pass at the first layer it reaches."""

    def __init__(self, module: nn.Module, arriving: Optional[int]) -> None:
        super().__init__()
        self.module, self.arriving = module, arriving


def _reach(model: nn.Module, channels: int, size: Sequence[int]) -> Optional[Tuple[str, nn.Module, Optional[int]]]:
    """``(name, layer, channels it gets)`` for the first layer with ``in_channels`` (a
    convolution) that an image of ``channels`` channels reaches in ``model``'s forward pass, or
    None when it reaches none (or fails before). The probe stops right before that layer runs."""
    names = {m: n for n, m in model.named_modules()}

    def stop(module: nn.Module, args: Any) -> None:
        x = args[0] if args else None
        raise _Reached(module, int(x.shape[1]) if isinstance(x, torch.Tensor) and x.dim() >= 2 else None)

    handles = [m.register_forward_pre_hook(stop) for m in model.modules()
               if isinstance(getattr(m, "in_channels", None), int)]
    try:
        with torch.inference_mode():
            model(torch.zeros(1, channels, int(size[1]), int(size[0])))
    except _Reached as reached:
        return names[reached.module], reached.module, reached.arriving
    except Exception:   # the probe input did not fit before any such layer
        return None
    finally:
        for handle in handles:
            handle.remove()
    return None


def first_layer(model: nn.Module, size: Sequence[int]) -> Optional[Tuple[str, nn.Module]]:
    """``(name, module)`` of the layer with ``in_channels`` (a convolution) that the image reaches
    first in ``model``'s forward pass on ``size`` ``[W, H]`` (probed with 3 channels, then 1, for
    a forward that looks at the channels before it), or None when it reaches none."""
    for channels in (CHANNELS_GUESS, 1):
        found = _reach(model, channels, size)
        if found is not None:
            return found[0], found[1]
    return None


def channels_of(model: nn.Module, size: Sequence[int], given: Optional[int] = None) -> Tuple[int, bool]:
    """``(channels, guessed)``: the channels the image has: those with which the layer it reaches
    first gets the channels it takes (its own, unless the forward makes them from the image first,
    e.g. a grayscale image repeated to RGB), or ``given`` (checked the same way); ``guessed`` when
    nothing tells (no convolution on the image's way).

    Raises:
        ValueError: ``given`` is not a positive integer, or the first layer does not get what it
            takes from an image of ``given`` channels (the message names both and the option).
    """
    if given is not None and (not isinstance(given, (int, np.integer)) or isinstance(given, bool) or given < 1):
        raise ValueError(f"channels={given!r} must be a positive integer (--channels 1 for grayscale, 3 for RGB)")
    if isinstance(model, torch.jit.ScriptModule):   # no hooks there: its first convolution registered
        first = next((m for m in model.modules() if isinstance(getattr(m, "in_channels", None), int)), None)
        return (int(given), False) if given is not None else (first.in_channels if first else CHANNELS_GUESS, True)
    found = first_layer(model, size)
    if found is None:
        return (int(given), False) if given is not None else (CHANNELS_GUESS, True)
    name, layer = found
    wanted = layer.in_channels

    def fits(channels: int) -> bool:
        reached = _reach(model, channels, size)
        return reached is not None and reached[1] is layer and reached[2] == wanted

    if given is not None:
        if fits(int(given)):
            return int(given), False
        fitting = next((c for c in dict.fromkeys([wanted, 1, 3]) if fits(c)), wanted)
        reached = _reach(model, int(given), size)
        got = f" and gets {reached[2]} from an image of {given}" if reached and reached[2] is not None else ""
        raise ValueError(f"channels={given}, but the layer the image reaches first ({name}, {type(layer).__name__}) "
                         f"takes {wanted} channel(s){got}; pass channels={fitting} (--channels {fitting})")
    fitting = next((c for c in dict.fromkeys([wanted, 1, 3]) if fits(c)), None)
    return (fitting, False) if fitting is not None else (wanted, True)


def check_one_input(model: nn.Module) -> None:
    """Refuse a model whose ``forward`` needs more than one input: export feeds it one image.

    Raises:
        ValueError: naming the forward's signature and what to do.
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):   # a forward without a signature (C code): the probe will tell
        return
    params = signature.parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    needed = [p.name for p in params if p.default is p.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(needed) > 1:
        names, star = [], False
        for p in params:
            if p.kind == p.KEYWORD_ONLY and not star:
                names.append("*")
                star = True
            names.append("**" + p.name if p.kind == p.VAR_KEYWORD else p.name)
        shown = ", ".join(names)
        raise ValueError(f"export takes one image input, and {type(model).__name__}.forward({shown}) needs "
                         f"{len(needed)} ({', '.join(needed)}): wrap the model in a module whose forward(x) takes "
                         f"the image alone and gives the other inputs their values")


def sample_shape(given: Optional[Sequence[int]], check: Any, input_size: Optional[Sequence[int]],
                 channels: Optional[int]) -> Optional[Tuple[int, ...]]:
    """The shape of one input that is not an image (no batch axis): ``given``, else that of a
    check array (or tensor) that is not ``(N, C, H, W)``; None for an image.

    Raises:
        ValueError: not positive integers, or given beside ``input_size``/``channels`` (images').
    """
    if given is None and isinstance(check, (np.ndarray, torch.Tensor)) and np.ndim(check) not in (0, 4):
        given = tuple(check.shape[1:])
    if given is None:
        return None
    dims = list(given) if isinstance(given, (list, tuple, torch.Size)) else [given]
    if not dims or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in dims):
        raise ValueError(f"input_shape={given!r} must be the positive sizes of one input without the batch axis "
                         f"(e.g. [16] for 16 features)")
    if input_size or channels:
        raise ValueError(f"input_shape={list(dims)} is one input of any shape; input_size={input_size!r} and "
                         f"channels={channels!r} describe an image: give one or the other")
    return tuple(int(v) for v in dims)


def input_size(given: Optional[Sequence[int]], trained: Optional[Sequence[int]]) -> List[int]:
    """``[W, H]``: ``given``, else the size the run trained at.

    Raises:
        ValueError: neither is known, or it is not two positive integers.
    """
    size = list(given) if given else (list(trained) if trained else None)
    if not size:
        raise ValueError("the input size is unknown: pass input_size=[W, H] (--input-size W H)")
    if len(size) != 2 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in size):
        raise ValueError(f"input_size={list(size)!r} must be two positive integers [W, H] (--input-size 32 32)")
    return [int(v) for v in size]


def check_forward(model: nn.Module, shape: Sequence[int], trained: Optional[Sequence[int]],
                  guessed: bool = False) -> None:
    """Run ``model`` on a batch of 2 inputs of ``shape`` (``(N, C, H, W)`` or a given input shape); a
    failure is one error that says what to pass (the size it trained at, the channels when they
    were guessed, the input shape).

    Raises:
        ValueError: the forward pass fails.
    """
    try:
        with torch.inference_mode():
            model(torch.zeros(2, *shape[1:]))
    except Exception as e:
        failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if len(shape) != 4:
            raise ValueError(f"the model cannot take inputs of shape {tuple(shape[1:])} (input_shape): its forward "
                             f"pass fails with {failure}") from None
        what = f"inputs of {shape[3]}x{shape[2]} (W x H) with {shape[1]} channel(s)"
        if guessed:
            raise ValueError(f"the model cannot take {what}: its forward pass fails with {failure}. "
                             f"{shape[1]} channels are a guess (no convolution takes the image): pass channels=C "
                             f"(--channels C), and the size it was trained at (--input-size W H)") from None
        if trained and list(trained) == [shape[3], shape[2]]:
            raise ValueError(f"the model's forward pass fails on {what}, the size it was trained at: "
                             f"{failure}") from None
        was = f" (it was trained at {trained[0]}x{trained[1]})" if trained else ""
        raise ValueError(f"the model cannot take {what}{was}: its forward pass fails with {failure}. "
                         f"Pass the size it was trained at (--input-size W H)") from None


def check_counts(**values: Any) -> None:
    """Refuse numeric options out of range, by name: ``batch``, ``calibration_images`` and
    ``threads``/``check_limit`` (when given) at least 1; ``runs`` and ``warmup`` at least 0.

    Raises:
        ValueError: ``<name>=<value> must be ...`` with the option to pass.
    """
    for name, value in values.items():
        if value is None and name in ("threads", "check_limit"):
            continue
        least = 0 if name in ("runs", "warmup") else 1
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
            kind = "a positive integer" if least else "an integer >= 0"
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name}={value!r} must be {kind} ({flag} N, e.g. {flag} {_EXAMPLE.get(name, 1)})")


_EXAMPLE = {"batch": 37, "runs": 20, "warmup": 3, "calibration_images": 200, "check_limit": 100, "threads": 4}
