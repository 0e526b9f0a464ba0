"""State across processes: resume after SIGKILL, evaluate/predict from a checkpoint, export."""
import os
import signal
import subprocess
import sys
from typing import Any, Dict, Tuple

import torch

from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from gpukit.image_toys import ImageTrainer, images, no_tf32
from gpukit.registry import Context, Skip, check, child_env
from toys import ToyTrainer, blobs, toy_cfg, weight_diff


# ----------------------------------------------------------------------------- resume after SIGKILL
def _resume_run(ctx: Context, work: str, kill=(-1, -1), resume: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gpukit.resume_run", work, ctx.device.type, str(kill[0]), str(kill[1]), resume]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=child_env(CUBLAS_WORKSPACE_CONFIG=":4096:8"))


@check("resume_sigkill_mid_epoch", budget_s=45, processes=True)
def resume_sigkill_mid_epoch(ctx: Context) -> Dict[str, Any]:
    """SIGKILL after step 4 of epoch 1, then ``resume: auto``, ends with the uninterrupted run's
    weights (within 1e-6, deterministic algorithms): dropout draws the device's generator every
    step (on CUDA the CUDA generator, restored from the checkpoint), random augmentation is drawn
    in 2 workers, ``pin_memory=True``. Dry run: the same on the CPU (the CPU generator)."""
    ref, run = ctx.folder("resume_ref"), ctx.folder("resume_run")
    done = _resume_run(ctx, ref)
    assert done.returncode == 0, f"uninterrupted run failed ({done.returncode}): {done.stderr[-1500:]}"
    killed = _resume_run(ctx, run, kill=(1, 3))
    assert killed.returncode == -signal.SIGKILL, f"the run to kill ended with {killed.returncode}: {killed.stderr[-1500:]}"
    state = torch.load(os.path.join(run, "model", "last.pth"), weights_only=True, map_location="cpu")
    where = (state["epoch"], state["phase"], state["batch"])
    assert where == (1, "train", 4), f"last.pth is at {where}, not (1, 'train', 4)"
    rngs = state.get("rng") or [{}]
    has_cuda_rng = "cuda" in (rngs[0] if isinstance(rngs, list) else rngs)
    assert has_cuda_rng == ctx.cuda, f"last.pth holds a CUDA generator state: {has_cuda_rng} (training on {ctx.device})"
    resumed = _resume_run(ctx, run, resume="auto")
    assert resumed.returncode == 0, f"resumed run failed ({resumed.returncode}): {resumed.stderr[-1500:]}"
    load = lambda w: torch.load(os.path.join(w, "final.pt"), weights_only=True)   # noqa: E731
    diff = weight_diff(load(ref), load(run))
    assert diff <= 1e-6, f"resumed vs uninterrupted: weights differ by {diff:.3g} (> 1e-6)"
    return {"weight_diff": diff, "checkpoint_at": list(where[::2]), "cuda_rng_saved": has_cuda_rng}


# ----------------------------------------------------------------------------- evaluate / predict, no run()
def _eval_callbacks(model_dir: str = ""):
    out = [AccuracyRecorder(indicator="Accuracy"), LossesRecorder(indicator="loss")]
    if model_dir:
        out.append(ModelCheckpoint(model_dir=model_dir, indicator="Accuracy", async_save=False))
    return out


@check("evaluate_predict_from_checkpoint", budget_s=15)
def evaluate_predict_from_checkpoint(ctx: Context) -> Dict[str, Any]:
    """A fresh trainer on the device, with no ``run()`` before, ``evaluate(checkpoint=last.pth)``
    gives the trained run's last test accuracy and loss (within 1e-6), and ``predict`` gives the
    trained model's outputs (within 1e-5), its model on the device. (On CUDA the recorders'
    states have never been moved to the device by ``on_train_begin``.) Dry run: on the CPU."""
    work = ctx.folder("evaluate")
    cfg = dict(gpu_id=ctx.gpu_id, num_epochs=2, n_train=128, n_test=50, batch_size=16, lr=0.1)
    with no_tf32():
        trained = ToyTrainer(toy_cfg(work_dir=work, **cfg), callbacks=_eval_callbacks(os.path.join(work, "model")))
        last = trained.run().last
        fresh = ToyTrainer(toy_cfg(**cfg), callbacks=_eval_callbacks())
        figures = fresh.evaluate(checkpoint=os.path.join(work, "model", "last.pth"))
        test = blobs(50, 4, seed=1)
        outputs = fresh.predict(test)
        with torch.no_grad():
            expected = trained.unwrapped_model.eval()(test.tensors[0].to(trained.device)).float().cpu()
    device = next(fresh.unwrapped_model.parameters()).device
    acc_diff = abs(figures["test/Accuracy"] - last["test/Accuracy"])
    loss_diff = abs(figures["test/loss"] - last["test/loss"])
    pred_diff = float((outputs.float().cpu() - expected).abs().max())
    figure = {"acc": figures["test/Accuracy"], "acc_diff": acc_diff, "loss_diff": loss_diff, "predict_diff": pred_diff,
              "model_device": str(device)}
    assert device.type == ctx.device.type, f"the evaluated model is on {device}, not {ctx.device}"
    assert acc_diff <= 1e-6 and loss_diff <= 1e-6 and pred_diff <= 1e-5, \
        f"evaluate {figures} vs trained {({k: last[k] for k in ('test/Accuracy', 'test/loss')})}, predict diff {pred_diff:.3g}"
    return figure


# ----------------------------------------------------------------------------- export
class ResnetTrainer(ImageTrainer):
    """torchvision's resnet18 for 32x32 (the model zoo's), on 3x32x32 synthetic images."""

    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(images(64, size=32), cfg.batch_size, 0, phase="train")

    def build_model(self, cfg, **kwargs):
        from basetrainer.models import build_models

        torch.manual_seed(cfg.seed)
        model = build_models.get_models(cfg.net_type, cfg.input_size, cfg.num_classes)
        return self.build_model_parallel(model, cfg.gpu_id, distributed=False)


def _export(ckpt: str, out_dir: str) -> Tuple[str, str, Any]:
    """The ONNX file of ``ckpt`` by ``deploy.export_model`` (checked against eager PyTorch),
    unsimplified and by the TorchScript exporter: the GPU machine's Python has onnx and onnxruntime
    but neither onnxslim nor onnxscript (the dynamo exporter's)."""
    from basetrainer.deploy import export as deploy_export

    report = deploy_export.export_model(ckpt, "onnx", out_dir=out_dir, runs=0, report_files=False, strict=False,
                                        simplify=False, exporter="torchscript")
    rows = {r.format: r for r in report.rows}
    assert report.ok, f"export failed: {[(r.format, r.status, r.problems) for r in report.failed]}"
    path = next(f for f in rows["onnx"].files if f.endswith(".onnx"))
    return path, "deploy.export_model", (rows["onnx"].parity or {}).get("max_abs")


@check("export_trained_checkpoint", budget_s=40)
def export_trained_checkpoint(ctx: Context) -> Dict[str, Any]:
    """A resnet18 trained on the device, its ``last.pth`` exported to ONNX by
    ``basetrainer.deploy.export_model`` (which checks the export against eager PyTorch on the
    CPU); then ONNX Runtime with its CUDA provider when the installed onnxruntime has it (else the
    CPU provider) agrees with the model on the device within 1e-3 (TF32 off)."""
    try:
        import onnx  # noqa: F401
        import onnxruntime as ort
    except ImportError as e:
        raise Skip(f"missing package: the export needs onnx and onnxruntime: {e}") from None
    work = ctx.folder("export")
    cfg = toy_cfg(gpu_id=ctx.gpu_id, num_epochs=1, batch_size=32, lr=0.05, net_type="resnet18", input_size=[32, 32],
                  num_classes=10, work_dir=work)
    with no_tf32():
        t = ResnetTrainer(cfg, callbacks=[LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss",
                                                          async_save=False)])
        t.run()
        ckpt = os.path.join(work, "model", "last.pth")
        onnx_file, route, parity = _export(ckpt, ctx.folder("export_out"))
        providers = ort.get_available_providers()
        use = "CUDAExecutionProvider" if ctx.cuda and "CUDAExecutionProvider" in providers else "CPUExecutionProvider"
        session = ort.InferenceSession(onnx_file, providers=[use])
        x = images(8, size=32, seed=3).tensors[0]
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        with torch.no_grad():
            want = t.unwrapped_model.eval()(x.to(t.device)).float().cpu().numpy()
    diff = float(abs(got - want).max())
    used = session.get_providers()[0]
    figure = {"ort_providers": ",".join(p.replace("ExecutionProvider", "") for p in providers), "used": used,
              "ort_vs_device_model": diff, "export_parity": parity, "route": route}
    assert used == use, f"ONNX Runtime ran on {used}, asked for {use}"
    assert diff <= 1e-3, f"ONNX Runtime ({used}) vs the model on {t.device}: max difference {diff:.3g} (> 1e-3)"
    return figure
