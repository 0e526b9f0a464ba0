"""One run of the resume check, as its own process (``python -m gpukit.resume_run``):

    python -m gpukit.resume_run WORK DEVICE KILL_EPOCH KILL_BATCH RESUME

A TinyNet with dropout (so the device's random generator is drawn every step: on CUDA the CUDA
generator) on blobs with random augmentation drawn in 2 worker processes (torch, numpy and
python's generators), ``pin_memory=True``, a resumable ``last.pth`` after every step; SIGKILL
after step KILL_BATCH of epoch KILL_EPOCH (-1: never). The final weights go to WORK/final.pt.
"""
import os
import random
import signal
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from toys import ToyTrainer, blobs, toy_cfg


class Augmented(Dataset):
    def __init__(self) -> None:
        self.data = blobs(100, 4, seed=0)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return x + 0.3 * torch.randn(16) + 0.2 * float(np.random.rand()) - 0.2 * random.random(), y


class Trainer(ToyTrainer):
    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(Augmented(), cfg.batch_size, cfg.num_workers, phase="train", pin_memory=True)

    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
        return self.build_model_parallel(model, cfg.gpu_id, distributed=False)


class Kill(Callback):
    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at = (epoch, batch)

    def on_batch_prepare(self, epoch, batch, logs=None):   # step `batch - 1` is over, its checkpoint written
        if (epoch, batch - 1) == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main(work: str, device: str, epoch: int, batch: int, resume: str) -> None:
    torch.use_deterministic_algorithms(True)   # CUBLAS_WORKSPACE_CONFIG is set by the check
    cfg = toy_cfg(gpu_id=[0] if device == "cuda" else [], num_epochs=2, batch_size=16, lr=0.1, momentum=0.9,
                  num_workers=2, work_dir=work, resume=resume, log_freq=3)
    callbacks = [LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss",
                                                   save_freq_steps=1, async_save=False)]
    if epoch >= 0:
        callbacks.append(Kill(epoch, batch))
    t = Trainer(cfg, callbacks=callbacks)
    t.run()
    assert t.device.type == device, f"trained on {t.device}, asked for {device}"
    torch.save({k: v.cpu() for k, v in t.unwrapped_model.state_dict().items()}, os.path.join(work, "final.pt"))


if __name__ == "__main__":
    w, d, e, b, r = sys.argv[1:6]
    main(w, d, int(e), int(b), r)
