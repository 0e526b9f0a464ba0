"""Models and helpers of the FSDP tests (a stack of identical blocks: what fully_shard wraps)."""
from typing import Any, Dict

import torch
from torch import nn

from basetrainer.runtime import comm, sharding

from toys import ToyTrainer, toy_cfg


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class BlockNet(nn.Module):
    """16 features -> width -> ``depth`` residual blocks -> classes (no BatchNorm, no dropout)."""

    def __init__(self, num_classes: int = 4, width: int = 24, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x))))


class TiedNet(nn.Module):
    """Blocks between an input projection and an output projection that share one weight."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16, bias=False)
        self.blocks = nn.Sequential(*[Block(16) for _ in range(2)])
        self.unstem = nn.Linear(16, 16, bias=False)
        self.unstem.weight = self.stem.weight
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.unstem(self.blocks(self.stem(x)))))


class BlockTrainer(ToyTrainer):
    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        model = TiedNet() if cfg.get("net") == "tied" else BlockNet()
        return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)


def fsdp_cfg(**overrides: Any):
    base = dict(num_epochs=3, n_train=251, n_test=31, batch_size=30, lr=0.2, momentum=0.9,
                distributed=comm.is_dist())
    base.update(overrides)
    return toy_cfg(**base)


def full_weights(trainer: Any) -> Dict[str, torch.Tensor]:
    """The whole model's weights on every rank (a collective under fsdp)."""
    model = trainer.unwrapped_model
    if sharding.is_fsdp(model):
        return {k: v.full_tensor().detach().clone() if hasattr(v, "full_tensor") else v.detach().clone()
                for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
