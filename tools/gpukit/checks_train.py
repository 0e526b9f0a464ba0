"""One device: the digits example, AMP, clipping under fp16, DataParallel, channels_last and compile."""
import copy
import math
import os
import shutil
import sys
from typing import Any, Dict, List

import torch
from torch import nn
from torch.utils.data import DataLoader

from basetrainer.callbacks.losses_recorder import LossesRecorder
from gpukit.image_toys import ImageTrainer, StepLosses, finite, images, no_tf32
from gpukit.registry import Context, Skip, check, need_cuda
from toys import ToyTrainer, toy_cfg, weight_diff

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------- the digits example
def _digits(ctx: Context) -> str:
    try:
        import sklearn  # noqa: F401
    except ImportError as e:
        raise Skip(f"missing package: scikit-learn (the digits data is made from its bundled set): {e}") from None
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from prepare_data import prepare_digits

    root = prepare_digits(os.path.join(ctx.tmp, "digits"))
    return _subset(root, os.path.join(ctx.tmp, "digits_small"), {"train": 10, "val": 10}) if ctx.cpu_dry_run else root


def _subset(root: str, small: str, per_class: Dict[str, int]) -> str:
    """The first ``per_class[split]`` images of each class (the dry run's digits)."""
    for split, count in per_class.items():
        for cls in sorted(os.listdir(os.path.join(root, split))):
            src, dst = os.path.join(root, split, cls), os.path.join(small, split, cls)
            os.makedirs(dst, exist_ok=True)
            for name in sorted(os.listdir(src))[:count]:
                if not os.path.exists(os.path.join(dst, name)):
                    shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return small


def _train_example(ctx: Context, root: str, gpu_id: List[int], epochs: int, name: str, *extra: str) -> float:
    import example   # examples/example.py, on sys.path by _digits

    argv = [*extra, "--work_dir", ctx.folder(name), "--train_data", os.path.join(root, "train"), "--test_data", os.path.join(root, "val"),
            "--num_epochs", str(epochs), "--no-progress", "--loggers", "csv",
            "--gpu_id", *map(str, gpu_id)]
    history = example.main(example.parse_config(argv))
    return float(history.last["test/Accuracy"])


@check("digits_example_accuracy", budget_s=90)
def digits_example_accuracy(ctx: Context) -> Dict[str, Any]:
    """examples/example.py (resnet18 at 32x32, the config's settings) trains on the digits on
    CUDA to the CPU run's test accuracy: |acc_cuda - acc_cpu| <= 0.03 (11 of 360 images) after 3
    epochs, both >= 0.95. Dry run (the path only: the 2-core CPU takes minutes per digits epoch):
    one epoch on 100 images at 8x8; its test accuracy is a fraction of the 100 test images and
    its last.pth records the epoch done."""
    root = _digits(ctx)
    if not ctx.cuda:
        acc = _train_example(ctx, root, [], 1, "digits_cpu", "--input_size", "8", "8")
        from basetrainer.runtime import checkpoint

        state = checkpoint.load_file(os.path.join(ctx.tmp, "digits_cpu", "model", "last.pth"))
        position = checkpoint.position(state)
        assert 0.0 <= acc <= 1.0 and abs(acc * 100 - round(acc * 100)) < 1e-6 and position[:2] == (0, "end"), \
            f"dry run: test accuracy {acc!r}, last.pth at {position}"
        return {"acc_cpu_dry": acc, "last_pth_at": list(position)}
    acc_cuda = _train_example(ctx, root, ctx.gpu_id, 3, "digits_cuda")
    acc_cpu = _train_example(ctx, root, [], 3, "digits_cpu")
    assert min(acc_cuda, acc_cpu) >= 0.95 and abs(acc_cuda - acc_cpu) <= 0.03, \
        f"test accuracy on CUDA {acc_cuda:.4f}, on the CPU {acc_cpu:.4f} (want both >= 0.95, within 0.03)"
    return {"acc_cuda": acc_cuda, "acc_cpu": acc_cpu, "diff": abs(acc_cuda - acc_cpu)}


# ----------------------------------------------------------------------------- AMP
def _amp_run(ctx: Context, amp: str) -> Dict[str, Any]:
    steps = StepLosses()
    t = ImageTrainer(toy_cfg(gpu_id=ctx.gpu_id, amp=amp, num_epochs=3, batch_size=32, lr=0.05, momentum=0.9,
                             n_train=ctx.size(512, 64)), callbacks=[LossesRecorder(), steps])
    history = t.run()
    return {"final_loss": float(history.last["train/loss"]), "steps": steps.values(),
            "scale": float(t.scaler.get_scale()) if t.scaler is not None else None}


AMP_TOLERANCE = {"fp16": 0.05, "bf16": 0.10}   # |final loss - fp32's| <= this x fp32's + 0.02, after 48 steps


def _amp_against_fp32(ctx: Context, amp: str) -> Dict[str, Any]:
    with no_tf32():
        ref = _amp_run(ctx, "none")
        got = _amp_run(ctx, amp)
    bad = [i for i, v in enumerate(got["steps"]) if not math.isfinite(v)]
    diff = abs(got["final_loss"] - ref["final_loss"])
    figure = {"fp32_loss": ref["final_loss"], f"{amp}_loss": got["final_loss"],
              "rel": diff / ref["final_loss"], "nonfinite_steps": len(bad), "steps": len(got["steps"])}
    if got["scale"] is not None:
        figure["final_scale"] = got["scale"]
    assert finite(ref["steps"]), "fp32 itself had a non-finite step"
    assert not bad and diff <= AMP_TOLERANCE[amp] * ref["final_loss"] + 0.02, \
        f"{amp}: non-finite steps {bad[:5]}, final loss {got['final_loss']:.5f} vs fp32 {ref['final_loss']:.5f} " \
        f"(allowed {AMP_TOLERANCE[amp]} x fp32 + 0.02)"
    return figure


@check("amp_fp16_gradscaler_vs_fp32", budget_s=15)
def amp_fp16_gradscaler_vs_fp32(ctx: Context) -> Dict[str, Any]:
    """AMP fp16 with the engine's GradScaler trains the small CNN for 48 steps with every step's
    loss finite and the last epoch's loss within 5 % (+0.02) of fp32's."""
    need_cuda(ctx, "amp: fp16 (the engine refuses it on the CPU)")
    return _amp_against_fp32(ctx, "fp16")


@check("amp_bf16_vs_fp32", budget_s=15)
def amp_bf16_vs_fp32(ctx: Context) -> Dict[str, Any]:
    """AMP bf16 trains the small CNN for 48 steps with every step's loss finite and the last
    epoch's loss within 10 % (+0.02) of fp32's. Dry run: 6 steps on the CPU (CPU autocast)."""
    return _amp_against_fp32(ctx, "bf16")


# ----------------------------------------------------------------------------- clipping under a GradScaler
CLIP = 0.1


def _hand_clipped(ctx: Context, cfg: Any, amp: bool) -> Dict[str, Any]:
    """The reference: scale, backward, unscale_, clip, step, update, on the same batches."""
    t = ImageTrainer(cfg)   # same initial weights and optimizer as the engine's run
    model, opt = t.model, t.optimizer
    scaler = torch.amp.GradScaler(ctx.device.type)
    norms = []
    for x, y in DataLoader(images(cfg.n_train), batch_size=cfg.batch_size, shuffle=False):
        x, y = x.to(ctx.device), y.to(ctx.device)
        with torch.autocast(ctx.device.type, dtype=torch.float16, enabled=amp):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return {"weights": copy.deepcopy(model.state_dict()), "norms": torch.stack(norms).float().cpu().tolist()}


@check("clip_with_fp16_unscales_first", budget_s=15)
def clip_with_fp16_unscales_first(ctx: Context) -> Dict[str, Any]:
    """clip_grad_norm with fp16's GradScaler clips the unscaled gradients: the engine's weights
    equal a hand loop's (scale, backward, unscale_, clip, step, update) within 1e-5, with clipping
    active (the unscaled norm exceeds the clip). Clipping the scaled gradients leaves steps
    ~65536x too short. Dry run: the same with ``torch.amp.GradScaler("cpu")`` and no autocast."""
    cfg = toy_cfg(gpu_id=ctx.gpu_id, amp="fp16" if ctx.cuda else "none", clip_grad_norm=CLIP, num_epochs=1,
                  batch_size=32, lr=0.5, n_train=ctx.size(256, 64), shuffle=False)
    with no_tf32():
        t = ImageTrainer(cfg)
        if not ctx.cuda:
            t.scaler = torch.amp.GradScaler("cpu")   # the engine keeps a scaler it is given
        t.run()
        ref = _hand_clipped(ctx, cfg, amp=ctx.cuda)
    diff = weight_diff(t.unwrapped_model.state_dict(), ref["weights"])
    figure = {"weight_diff": diff, "max_unscaled_norm": max(ref["norms"]), "clip": CLIP,
              "scale": float(t.scaler.get_scale())}
    assert max(ref["norms"]) > CLIP, f"clipping never active (norms {ref['norms'][:4]}...): the check proves nothing"
    assert diff <= 1e-5, f"engine vs hand unscale-then-clip: weights differ by {diff:.3g} (> 1e-5)"
    return figure


# ----------------------------------------------------------------------------- DataParallel
class DPTrainer(ToyTrainer):
    """ToyTrainer whose model is DataParallel over every visible device (none on the CPU)."""

    def build_model(self, cfg: Any, **kwargs: Any) -> nn.Module:
        model = super().build_model(cfg, **kwargs)
        ids = list(range(torch.cuda.device_count())) if self.device.type == "cuda" else []
        return nn.DataParallel(model, device_ids=ids)


@check("dataparallel_loss_in_replica", budget_s=15)
def dataparallel_loss_in_replica(ctx: Context) -> Dict[str, Any]:
    """DataParallel over the visible devices with ``loss_in_replica`` (each replica computes its
    slice's loss sum and count; the engine divides the gathered sums) trains like the bare model
    on one device: weights within 1e-5, per-epoch train loss within 1e-5 relative. With one GPU
    DataParallel has one replica (the uneven split between replicas needs two).
    Dry run: DataParallel on the CPU (no replicas: it calls the module)."""
    cfg = dict(gpu_id=ctx.gpu_id, num_epochs=2, n_train=100, batch_size=16, lr=0.1, momentum=0.9)
    with no_tf32():
        bare = ToyTrainer(toy_cfg(**cfg), callbacks=[LossesRecorder()])
        bare_history = bare.run()
        dp = DPTrainer(toy_cfg(loss_in_replica=True, **cfg), callbacks=[LossesRecorder()])
        dp_history = dp.run()
    assert dp.loss_in_replica and isinstance(dp.model, nn.DataParallel), "the trainer did not put the loss in the replicas"
    diff = weight_diff(bare.unwrapped_model.state_dict(), dp.unwrapped_model.state_dict())
    a, b = bare_history["train/loss"], dp_history["train/loss"]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert diff <= 1e-5 and rel <= 1e-5, f"DataParallel(loss_in_replica) vs bare: weights {diff:.3g}, losses {a} vs {b}"
    return {"replicas": len(dp.model.device_ids), "weight_diff": diff, "loss_rel": rel}


# ----------------------------------------------------------------------------- channels_last, compile
LAYOUT_TOLERANCE = 2e-3   # largest weight difference after 16 float32 steps (TF32 off), and relative loss


def _against_eager(ctx: Context, name: str, **over: Any) -> Dict[str, Any]:
    cfg = dict(gpu_id=ctx.gpu_id, num_epochs=2, n_train=ctx.size(256, 64), batch_size=32, lr=0.05, momentum=0.9)
    with no_tf32():
        eager = ImageTrainer(toy_cfg(**cfg), callbacks=[LossesRecorder()])
        ref_loss = eager.run().last["train/loss"]
        t = ImageTrainer(toy_cfg(**cfg, **over), callbacks=[LossesRecorder()])
        loss = t.run().last["train/loss"]
    diff = weight_diff(eager.unwrapped_model.state_dict(), t.unwrapped_model.state_dict())
    rel = abs(loss - ref_loss) / ref_loss
    assert diff <= LAYOUT_TOLERANCE and rel <= LAYOUT_TOLERANCE, \
        f"{name} vs eager: weights differ by {diff:.3g}, last loss {loss:.6f} vs {ref_loss:.6f} (tolerance {LAYOUT_TOLERANCE})"
    return {"weight_diff": diff, "loss_rel": rel, "trainer": t}


@check("channels_last_vs_eager", budget_s=15)
def channels_last_vs_eager(ctx: Context) -> Dict[str, Any]:
    """``channels_last: true`` trains the small CNN (BatchNorm, 2 epochs, TF32 off) to eager's
    weights within 2e-3 and its last train loss within 2e-3 relative, its conv weights
    channels_last. Dry run: on the CPU."""
    figure = _against_eager(ctx, "channels_last", channels_last=True)
    conv = figure.pop("trainer").unwrapped_model.features[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last), "conv weights are not channels_last"
    return figure


@check("compile_vs_eager", budget_s=60)
def compile_vs_eager(ctx: Context) -> Dict[str, Any]:
    """``compile: true`` (inductor) trains the small CNN to eager's weights within 2e-3 and its
    last train loss within 2e-3 relative (TF32 off)."""
    need_cuda(ctx, "inductor compiles a C++ kernel per graph on the CPU: minutes on the 2-core CI machine")
    if not (os.environ.get("CC") or any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
        raise Skip("missing package: a C compiler (triton builds its CUDA launcher with one; none on PATH, CC unset)")
    figure = _against_eager(ctx, "compile", compile=True)
    figure.pop("trainer")
    return figure


# ----------------------------------------------------------------------------- pinned memory
@check("pinned_batches_to_device", budget_s=10)
def pinned_batches_to_device(ctx: Context) -> Dict[str, Any]:
    """On CUDA the default loader (2 workers) pins its batches (``pin_memory`` defaults to on)
    and every step the engine sees the batch on the device, equal to the loader's."""
    need_cuda(ctx, "pinned host memory and non_blocking copies exist only with a CUDA device")
    seen: List[Any] = []

    class Keep(LossesRecorder):
        def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
            seen.append((inputs[0].device.type, inputs[0].detach().cpu()))

    t = ToyTrainer(toy_cfg(gpu_id=ctx.gpu_id, num_workers=2, n_train=64, num_epochs=1, shuffle=False), callbacks=[Keep()])
    first = next(iter(t.train_loader))[0]
    t.run()
    devices = {d for d, _ in seen}
    assert t.train_loader.pin_memory and first.is_pinned(), f"pin_memory {t.train_loader.pin_memory}, pinned {first.is_pinned()}"
    assert devices == {"cuda"} and torch.equal(seen[0][1], first), f"batches seen on {devices}"
    return {"pin_memory": True, "pinned": first.is_pinned(), "steps_on_cuda": len(seen)}
