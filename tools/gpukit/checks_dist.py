"""Processes: DDP through ``launch()`` (NCCL with one process; two processes on one GPU over
gloo) and FSDP2 with its sharded checkpoint resumed in one plain process."""
import os
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.engine.launch import launch
from basetrainer.runtime import checkpoint
from gpukit.registry import Context, check
from toys import ToyTrainer, toy_cfg, weight_diff

DDP_CFG = dict(num_epochs=2, n_train=100, batch_size=16, lr=0.1, momentum=0.9)


def _train_toy(cfg: Dict[str, Any], out: Optional[str]) -> None:
    """Train the toy (deterministic algorithms); the main process saves weights, losses and the
    backend to ``out``. Module level: launch pickles it into the processes it starts."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        t = ToyTrainer(toy_cfg(**cfg), callbacks=[LossesRecorder()])
        history = t.run()
    finally:   # it also runs in the kit's own process: later checks train as usual
        torch.use_deterministic_algorithms(was)
    if out and t.is_main_process:
        torch.save({"weights": {k: v.detach().cpu() for k, v in t.unwrapped_model.state_dict().items()},
                    "losses": history["train/loss"], "device": str(t.device), "world": t.world_size,
                    "backend": dist.get_backend() if dist.is_initialized() else "none"}, out)


def _one_process(ctx: Context) -> Dict[str, Any]:
    out = os.path.join(ctx.folder("ddp"), "one_process.pt")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before CUDA's first cuBLAS call
    _train_toy(dict(gpu_id=ctx.gpu_id, **DDP_CFG), out)
    return torch.load(out, weights_only=True)


def _launched(ctx: Context, name: str, gpu_id: list, backend: Optional[str]) -> Dict[str, Any]:
    out = os.path.join(ctx.folder("ddp"), f"{name}.pt")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"   # the spawned ranks inherit it
    launch(_train_toy, num_gpus_per_machine=max(1, len(gpu_id)), dist_url="auto", distributed=True,
           backend=backend, timeout=120, args=(dict(gpu_id=gpu_id, distributed=True, **DDP_CFG), out))
    return torch.load(out, weights_only=True)


@check("ddp_nccl_one_process_launch", budget_s=30, processes=True)
def ddp_nccl_one_process_launch(ctx: Context) -> Dict[str, Any]:
    """``launch(distributed=True)`` with one process picks NCCL on CUDA and trains on cuda:0 like
    the same script without launch: weights within 1e-6. Dry run: the same on gloo, CPU."""
    ref = _one_process(ctx)
    got = _launched(ctx, "nccl_1", [0] if ctx.cuda else [], backend=None)
    want_backend = "nccl" if ctx.cuda else "gloo"
    diff = weight_diff(ref["weights"], got["weights"])
    figure = {"backend": got["backend"], "device": got["device"], "weight_diff": diff}
    assert got["backend"] == want_backend and got["device"].startswith(ctx.device.type), \
        f"launch used {got['backend']} on {got['device']}, want {want_backend} on {ctx.device.type}"
    assert diff <= 1e-6, f"one launched process vs a plain one: weights differ by {diff:.3g}"
    return figure


@check("ddp_two_processes_one_gpu_gloo", budget_s=40, processes=True)
def ddp_two_processes_one_gpu_gloo(ctx: Context) -> Dict[str, Any]:
    """Two DDP processes on the one GPU (``gpu_id: [0, 0]``; NCCL refuses two ranks on one
    device, so gloo, which all-reduces CUDA tensors through host memory) train like one process
    under ``torch.use_deterministic_algorithms(True)``: weights within 1e-5, per-epoch loss within
    1e-5 relative (the global batch is split 8 + 8). Dry run: two gloo processes on the CPU."""
    ref = _one_process(ctx)
    got = _launched(ctx, "gloo_2", [0, 0], backend="gloo")   # [0, 0] on a machine without CUDA: the CPU
    diff = weight_diff(ref["weights"], got["weights"])
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], got["losses"]))
    figure = {"world": got["world"], "backend": got["backend"], "device": got["device"], "weight_diff": diff,
              "loss_rel": rel}
    assert got["world"] == 2 and got["device"].startswith(ctx.device.type), f"ran {got['world']} ranks on {got['device']}"
    assert diff <= 1e-5 and rel <= 1e-5, f"2 processes vs 1: weights differ by {diff:.3g}, losses {got['losses']} vs {ref['losses']}"
    return figure


# ----------------------------------------------------------------------------- FSDP2
def _fsdp_part(cfg: Dict[str, Any]) -> None:
    from fsdp_common import BlockTrainer, fsdp_cfg

    cfg = dict(cfg)
    out, work = cfg.pop("out", None), cfg["work_dir"]
    callbacks = [LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss",
                                                   async_save=False)]
    t = BlockTrainer(fsdp_cfg(**cfg), callbacks=callbacks)
    t.run()
    if t.is_main_process and out:
        torch.save({k: v.detach().cpu() for k, v in t.unwrapped_model.state_dict().items()}, out)


@check("fsdp2_sharded_checkpoint_resumed_in_one_process", budget_s=40, processes=True)
def fsdp2_sharded_checkpoint_resumed_in_one_process(ctx: Context) -> Dict[str, Any]:
    """``strategy: fsdp`` in one launched process (NCCL on CUDA) trains 2 epochs and writes a
    sharded ``last.pth``; a plain process (no group, ``strategy: ddp``) resumes it for a third
    epoch and ends with the weights of 3 uninterrupted epochs in one process (within 1e-5).
    Dry run: the same over gloo on the CPU."""
    work = ctx.folder("fsdp_run")
    base = dict(gpu_id=ctx.gpu_id, work_dir=work)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    launch(_fsdp_part, num_gpus_per_machine=1, dist_url="auto", distributed=True, timeout=120,
           args=(dict(base, strategy="fsdp", num_epochs=2, distributed=True),))
    state = checkpoint.load_file(os.path.join(work, "model", "last.pth"))
    assert state.get("shards"), f"last.pth of the fsdp run is not sharded (keys {sorted(state)[:8]})"
    resumed_out = os.path.join(ctx.folder("fsdp"), "resumed.pt")
    _fsdp_part(dict(base, strategy="ddp", num_epochs=3, distributed=False, resume="auto", out=resumed_out))
    ref_out = os.path.join(ctx.folder("fsdp"), "reference.pt")
    _fsdp_part(dict(base, work_dir=ctx.folder("fsdp_reference"), strategy="ddp", num_epochs=3, distributed=False,
                    out=ref_out))
    diff = weight_diff(torch.load(ref_out, weights_only=True), torch.load(resumed_out, weights_only=True))
    assert diff <= 1e-5, f"fsdp (2 epochs) + resume in one process vs 3 epochs: weights differ by {diff:.3g}"
    return {"sharded_world": state.get("world_size"), "weight_diff": diff}
