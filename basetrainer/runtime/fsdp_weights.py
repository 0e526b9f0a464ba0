"""Rank 0's weights into every rank's shards, for ``strategy: fsdp``
(:func:`basetrainer.runtime.fsdp_build.shard`): tied parameters, and buffers shared by several
modules, kept one tensor across the moves to ``meta`` and back; rank 0's full weights taken
before sharding and given to every rank after it.
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from basetrainer.runtime import comm


def tied(model: nn.Module, blocks: List[nn.Module]) -> List[List[str]]:
    """Names of the parameters shared by several modules (tied weights), one list per
    parameter; each must lie in one sharded unit (one block, or outside every block).

    Raises:
        ValueError: a parameter is shared by two blocks, or by a block and the rest of the model.
    """
    groups: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    block_names = {id(m): n for n, m in model.named_modules() if any(m is b for b in blocks)}
    prefixes = sorted(block_names.values(), key=len, reverse=True)
    ties = [names for names in groups.values() if len(names) > 1]
    for names in ties:
        units = {next((p for p in prefixes if n.startswith(p + ".")), "<root>") for n in names}
        if len(units) > 1:
            raise ValueError(f"strategy: fsdp: the parameters {names} are one tied parameter shared by "
                             f"{sorted(units)}, which are sharded separately; choose blocks that keep it in "
                             f"one of them (fsdp_wrap or wrap_policy), or untie it")
    return ties


def retie(model: nn.Module, ties: List[List[str]]) -> None:
    for names in ties:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, shared)


def shared_buffers(model: nn.Module) -> List[List[str]]:
    """Names of the buffers registered in several modules (one mask or positional table in
    every block), one list per buffer. Buffers are not sharded, so any placement is fine."""
    groups: Dict[int, List[str]] = {}
    for name, buf in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(buf), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie_buffers(model: nn.Module, shared: List[List[str]]) -> None:
    """Make every name of a shared buffer hold one tensor again (``.to()`` and ``to_empty``
    give each module its own copy)."""
    for names in shared:
        tensor = model.get_buffer(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            # assigning a tensor to a buffer's name replaces the buffer (nn.Module.__setattr__),
            # persistent or not as it was registered
            setattr(model.get_submodule(owner) if owner else model, attr, tensor)


def full_weights(model: nn.Module) -> Tuple[dict, dict]:
    """Rank 0's ``state_dict()`` and its non-persistent buffers by name (those no state_dict
    holds), before sharding replaces them."""
    return ({k: v.detach() for k, v in model.state_dict().items()},
            {name: buf.detach() for name, buf in _non_persistent_buffers(model)})


def _non_persistent_buffers(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The buffers ``state_dict()`` leaves out (registered with ``persistent=False``), each
    tensor once (under its first name)."""
    saved = set(model.state_dict(keep_vars=True))
    return [(name, buf) for name, buf in model.named_buffers() if name not in saved]


def scatter_from_rank0(model: nn.Module, full: Optional[Tuple[dict, dict]], device: torch.device) -> None:
    """Give every rank rank 0's weights: what ``state_dict()`` holds through torch's
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` (each rank keeps
    its shard of every parameter, and the buffers), and the non-persistent buffers by a
    broadcast here: torch's function loads a state_dict only, and measured without this step
    the ``pos`` table of tests/test_fsdp_defects.py's SharedBufferNet (registered with
    ``persistent=False``) stayed as ``to_empty`` left it, 2e17 from the one-process weights."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state, others = full if full is not None else ({}, {})
    # the other ranks run this inside construct()'s torch.device("meta"): the library makes
    # tensors without a device (shard offsets), which would land on meta
    with torch.device(device):
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, buf in _non_persistent_buffers(model):
            if full is not None:
                buf.copy_(others[name].to(device))
            if comm.get_world_size() > 1:
                dist.broadcast(buf, src=0)
