"""The speed benchmarks of bench/bench_gpu.py as kit checks (kind ``bench``): on CUDA each model
case asserts its budget on the median ratio; every case asserts that basetrainer did the hand
loop's work (the warm-up epoch's first three step losses within 1 %). The dry run runs tiny sizes on the CPU:
the code paths, no budget."""
import os
import sys
from typing import Any, Dict

from gpukit.registry import ROOT, Context, Skip, check

sys.path.append(os.path.join(ROOT, "bench"))
import bench_gpu  # noqa: E402


def _model_check(case: str, ctx: Context) -> Dict[str, Any]:
    figure = bench_gpu.model_case(case, ctx.device, ctx.cpu_dry_run)
    ours = figure["basetrainer"]
    assert ours["first_losses_rel"] <= bench_gpu.SAME_WORK, \
        f"basetrainer's first step losses differ from the hand loop's by {ours['first_losses_rel']:.3g} (> {bench_gpu.SAME_WORK})"
    out = {"ratio": ours["ratio"], "interval": ours["interval"], "overhead_us_per_step": ours["overhead_us_per_step"],
           "hand_ms_per_step": figure["hand_ms_per_step"], "first_losses_rel": ours["first_losses_rel"]}
    if ctx.cuda:
        assert ours["ratio"] <= bench_gpu.BUDGET[case], \
            f"basetrainer / hand = {ours['ratio']:.4f} [{ours['interval'][0]:.4f}, {ours['interval'][1]:.4f}] " \
            f"> budget {bench_gpu.BUDGET[case]}"
    else:
        out["budget"] = "not applied (dry run)"
    return out


@check("speed_resnet50_bf16_b128", budget_s=45, kind="bench")
def speed_resnet50_bf16_b128(ctx: Context) -> Dict[str, Any]:
    """resnet50, AMP bf16, batch 128, channels_last, synthetic data on the GPU: basetrainer
    <= 1.02x the hand loop's seconds per epoch (median of 7 interleaved pairs)."""
    return _model_check("resnet50_bf16", ctx)


@check("speed_small_resnet_b512", budget_s=30, kind="bench")
def speed_small_resnet_b512(ctx: Context) -> Dict[str, Any]:
    """ResNet-9 at 32x32, batch 512, AMP bf16, data on the GPU: basetrainer <= 1.05x the hand
    loop (median of 12 interleaved pairs)."""
    return _model_check("small_resnet_b512", ctx)


@check("speed_peers_lightning_accelerate", budget_s=70, kind="bench")
def speed_peers_lightning_accelerate(ctx: Context) -> Dict[str, Any]:
    """Lightning and Accelerate on the same two models, each against the hand loop (figures
    only; each must do the hand loop's work: first three step losses within 1 %)."""
    out: Dict[str, Any] = {}
    for case in bench_gpu.SIZES:
        figure = bench_gpu.model_case(case, ctx.device, ctx.cpu_dry_run, peers=True)
        if len(figure) == 1:
            raise Skip(f"missing package: neither peer imports: {figure['missing']}")
        for peer, missing in figure["missing"].items():
            out[f"{peer}"] = f"not importable ({missing[:80]})"
        for peer in (p for p in ("lightning", "accelerate") if p in figure):
            got = figure[peer]
            assert got["first_losses_rel"] <= bench_gpu.SAME_WORK, \
                f"{peer} on {case}: first step losses off by {got['first_losses_rel']:.3g} (> {bench_gpu.SAME_WORK})"
            out[f"{case}_{peer}_ratio"] = got["ratio"]
            out[f"{case}_{peer}_first_losses_rel"] = got["first_losses_rel"]
            out[f"{case}_{peer}_interval"] = got["interval"]
    return out


@check("speed_loader_digits", budget_s=40, kind="bench")
def speed_loader_digits(ctx: Context) -> Dict[str, Any]:
    """Images/s of the default loader on the digits ImageFolder (the example's transforms), 0
    and 4 workers, pin_memory on CUDA, against a plain DataLoader (figures; every image once)."""
    from gpukit.checks_train import _digits

    root = _digits(ctx)
    figure = bench_gpu.loader_case(os.path.join(root, "train"), ctx.device, ctx.cpu_dry_run)
    out: Dict[str, Any] = {"pin_memory": figure["pin_memory"]}
    for key in (k for k in figure if k.startswith("w")):
        f = figure[key]
        out[f"{key}_images_per_s"] = round(f["images_per_s"])
        out[f"{key}_hand_images_per_s"] = round(f["hand_images_per_s"])
        out[f"{key}_ratio"] = f["ratio"]
        out[f"{key}_interval"] = f["interval"]
    return out
