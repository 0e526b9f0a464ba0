"""GlobalBatchNorm (models/sync_batchnorm.py) on 2 gloo processes equals BatchNorm over the
global batch: the mean and variance it uses equal a float64 reference within 1e-5 relative on
hard data (mean 1000 / std 0.01, also under bf16 autocast), for ranks of unequal size, a rank
holding no sample and a rank running a placeholder batch; outputs, gradients and running
statistics equal a single-process BatchNorm over the concatenated batch."""
import contextlib
import traceback

import pytest
import torch
from torch import nn

from basetrainer.models import sync_batchnorm
from basetrainer.models.sync_batchnorm import GlobalBatchNorm

from conftest import run_distributed

TIMEOUT = 120

# name -> how the global batch is made and split. momentum 1.0 makes the running statistics
# the batch's own (mean, unbiased variance), so they show what the layer used.
CASES = {
    "mean1000_std0.01": dict(mean=1000.0, std=0.01, sizes=(8, 8), shape=(4,), momentum=1.0),
    "mean1000_std0.01_bf16_autocast": dict(mean=1000.0, std=0.01, sizes=(8, 8), shape=(4,), momentum=1.0,
                                           autocast=True),
    "mean100_std0.1": dict(mean=100.0, std=0.1, sizes=(8, 8), shape=(4,), momentum=1.0),
    "ranks_5_and_3_2d": dict(mean=1000.0, std=0.01, sizes=(5, 3), shape=(3, 2, 2), momentum=1.0),
    "rank_holds_0": dict(mean=1000.0, std=0.01, sizes=(6, 0), shape=(4,), momentum=1.0),
    # activations under autocast are bfloat16: statistics of the bf16 values, output in bf16
    "bf16_input_autocast": dict(mean=3.0, std=2.0, sizes=(6, 4), shape=(4,), momentum=1.0, autocast=True,
                                dtype=torch.bfloat16),
    "ordinary_1d": dict(mean=0.5, std=2.0, sizes=(7, 5), shape=(4,), momentum=0.1),
    "ordinary_2d_unequal": dict(mean=-1.0, std=3.0, sizes=(5, 3), shape=(3, 4, 4), momentum=0.1),
    "ordinary_momentum_none": dict(mean=2.0, std=1.5, sizes=(4, 6), shape=(5,), momentum=None),
    "placeholder_on_rank_1": dict(mean=1000.0, std=0.01, sizes=(6, 1), shape=(4,), momentum=1.0,
                                  placeholder_rank=1),
}


def make_case(name):
    """The case's per-rank inputs (float32), loss weights, and the layer's weight and bias."""
    spec = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    channels = spec["shape"][0]
    offsets = torch.arange(channels, dtype=torch.float64).reshape([1, channels] + [1] * (len(spec["shape"]) - 1))
    shards, grads = [], []
    for size in spec["sizes"]:
        x = torch.randn((size,) + spec["shape"], generator=g, dtype=torch.float64) * spec["std"] + spec["mean"]
        shards.append((x + offsets * spec["std"]).to(spec.get("dtype", torch.float32)))  # channels differ a little
        grads.append(torch.randn((size,) + spec["shape"], generator=g))
    if spec.get("placeholder_rank") is not None:
        grads[spec["placeholder_rank"]].zero_()  # a placeholder's loss weight is 0
    weight = 1 + 0.5 * torch.randn(channels, generator=g)
    bias = torch.randn(channels, generator=g)
    return shards, grads, weight, bias


def _layer(spec, weight, bias, dtype=torch.float32):
    cls = nn.BatchNorm1d if len(spec["shape"]) == 1 else nn.BatchNorm2d
    layer = cls(spec["shape"][0], momentum=spec["momentum"]).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def _run_case(rank, name):
    spec = CASES[name]
    shards, grads, weight, bias = make_case(name)
    layer = sync_batchnorm.convert_sync_batchnorm(_layer(spec, weight, bias))
    assert isinstance(layer, GlobalBatchNorm)
    x = shards[rank].clone().requires_grad_(True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if spec.get("autocast") else contextlib.nullcontext()
    # every rank looks the hook up, so that all fail alike (not one mid-collective) where it is missing
    hook = sync_batchnorm.placeholder_batch if "placeholder_rank" in spec else None
    placeholder = hook() if spec.get("placeholder_rank") == rank else contextlib.nullcontext()
    with autocast, placeholder:
        out = layer(x)
    (out.float() * grads[rank]).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "weight_grad": layer.weight.grad, "bias_grad": layer.bias.grad,
            "running_mean": layer.running_mean.clone(), "running_var": layer.running_var.clone(),
            "num_batches_tracked": int(layer.num_batches_tracked)}


def _all_cases(rank):
    results = {}
    for name in CASES:
        try:
            results[name] = _run_case(rank, name)
        except Exception:
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    """Every case, run once on 2 gloo processes: a list of per-rank {case: result or traceback}."""
    return run_distributed(_all_cases, 2, tmp_path_factory.mktemp("sync_bn"), timeout=TIMEOUT)


def reference(name, dtype):
    """BatchNorm in one process over the batch the case's ranks really contribute, in ``dtype``."""
    spec = CASES[name]
    shards, grads, weight, bias = make_case(name)
    keep = [r for r in range(len(shards)) if r != spec.get("placeholder_rank")]
    layer = _layer(spec, weight, bias, dtype)
    x = torch.cat([shards[r] for r in keep]).to(dtype).requires_grad_(True)
    out = layer(x)
    (out * torch.cat([grads[r] for r in keep]).to(dtype)).sum().backward()
    x64 = x.detach().double()
    dims = [0] + list(range(2, x64.dim()))
    return {"out": out.detach(), "x_grad": x.grad, "weight_grad": layer.weight.grad, "bias_grad": layer.bias.grad,
            "running_mean": layer.running_mean, "running_var": layer.running_var,
            "mean64": x64.mean(dims), "var64": x64.var(dims, unbiased=False), "unbiased64": x64.var(dims),
            "keep": keep, "sizes": spec["sizes"]}


def max_rel(a, b):
    return ((a.double() - b.double()).abs() / b.double().abs()).max().item()


def assert_close(name, what, got, want, tol):
    """``got`` equals ``want`` within ``tol`` relative to the largest magnitude of ``want``."""
    assert got.shape == want.shape, f"{name}: {what} has shape {tuple(got.shape)}, not {tuple(want.shape)}"
    if not want.numel():
        return
    scale = want.double().abs().max().clamp(min=1).item()
    err = (got.double() - want.double()).abs().max().item() / scale
    assert err <= tol, f"{name}: {what} differs by {err:.3g} (relative to {scale:.3g}), more than {tol}"


def rank_results(distributed_results, name):
    found = [r[name] for r in distributed_results]
    for rank, res in enumerate(found):
        assert not isinstance(res, str), f"{name} failed on rank {rank}:\n{res}"
    return found


HARD = ["mean1000_std0.01", "mean1000_std0.01_bf16_autocast", "mean100_std0.1", "ranks_5_and_3_2d",
        "rank_holds_0", "placeholder_on_rank_1"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", HARD + ["bf16_input_autocast"])
def test_mean_and_variance_equal_a_float64_reference(distributed_results, name):
    ranks = rank_results(distributed_results, name)
    ref = reference(name, torch.float64)
    n = sum(ref["sizes"][r] for r in ref["keep"]) * ref["out"][0, 0].numel()  # values per channel
    for rank, res in enumerate(ranks):
        # momentum 1.0: running_mean is the batch mean, running_var the unbiased batch variance
        assert max_rel(res["running_mean"], ref["mean64"]) <= 1e-5, f"{name} rank {rank}: mean"
        assert max_rel(res["running_var"], ref["unbiased64"]) <= 1e-5, f"{name} rank {rank}: variance"
        assert max_rel(res["running_var"] * (n - 1) / n, ref["var64"]) <= 1e-5
        assert res["num_batches_tracked"] == 1


@pytest.mark.distributed
@pytest.mark.parametrize("name", HARD)
def test_outputs_and_gradients_equal_float64_batchnorm_on_hard_data(distributed_results, name):
    ranks = rank_results(distributed_results, name)
    ref = reference(name, torch.float64)
    start = 0
    for rank in ref["keep"]:
        res, stop = ranks[rank], start + ref["sizes"][rank]
        assert res["out"].dtype == torch.float32 and res["out"].shape[0] == ref["sizes"][rank]
        assert_close(name, f"rank {rank} output", res["out"], ref["out"][start:stop], 1e-5)
        assert_close(name, f"rank {rank} input gradient", res["x_grad"], ref["x_grad"][start:stop], 1e-5)
        start = stop
    for key in ("weight_grad", "bias_grad"):  # DDP sums (averages) the ranks' parameter gradients
        assert_close(name, key, sum(r[key] for r in ranks), ref[key], 1e-5)


@pytest.mark.distributed
def test_bf16_input_gives_bf16_output_normalised_with_the_global_statistics(distributed_results):
    ranks = rank_results(distributed_results, "bf16_input_autocast")
    ref = reference("bf16_input_autocast", torch.float64)
    out = torch.cat([r["out"] for r in ranks])
    assert out.dtype == torch.bfloat16
    assert_close("bf16_input_autocast", "output", out, ref["out"], 2 ** -8)  # bf16 keeps 8 bits


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ordinary_1d", "ordinary_2d_unequal", "ordinary_momentum_none"])
def test_outputs_gradients_and_running_stats_equal_torch_batchnorm(distributed_results, name):
    ranks = rank_results(distributed_results, name)
    ref = reference(name, torch.float32)
    start = 0
    for rank, res in enumerate(ranks):
        stop = start + ref["sizes"][rank]
        assert torch.allclose(res["out"], ref["out"][start:stop], atol=1e-5, rtol=0)
        assert torch.allclose(res["x_grad"], ref["x_grad"][start:stop], atol=1e-5, rtol=0)
        assert torch.allclose(res["running_mean"], ref["running_mean"], atol=1e-6, rtol=0)
        assert torch.allclose(res["running_var"], ref["running_var"], atol=1e-6, rtol=0)
        start = stop
    for key in ("weight_grad", "bias_grad"):
        assert torch.allclose(sum(r[key] for r in ranks), ref[key], atol=1e-5, rtol=0), key


@pytest.mark.distributed
def test_rank_holding_0_returns_an_empty_output_and_zero_parameter_gradients(distributed_results):
    empty = rank_results(distributed_results, "rank_holds_0")[1]
    assert empty["out"].shape == (0, 4) and empty["x_grad"].shape == (0, 4)
    assert torch.equal(empty["weight_grad"], torch.zeros(4)) and torch.equal(empty["bias_grad"], torch.zeros(4))


def test_placeholder_batch_alone_leaves_the_running_statistics_alone():
    layer = GlobalBatchNorm(3)
    x = torch.randn(4, 3) * 5 + 2
    with sync_batchnorm.placeholder_batch():
        out = layer(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert torch.equal(layer.running_mean, torch.zeros(3)) and torch.equal(layer.running_var, torch.ones(3))
    assert int(layer.num_batches_tracked) == 0
    layer(x)  # outside the block the batch counts again
    assert torch.allclose(layer.running_mean, 0.1 * x.mean(0))


def test_alone_or_in_eval_it_is_plain_batchnorm():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    glob = sync_batchnorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))[0]
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    assert torch.allclose(glob(x), bn(x), atol=1e-6)
    assert torch.allclose(glob.running_var, bn.running_var, atol=1e-6)
    glob.eval(), bn.eval()
    assert torch.allclose(glob(x), bn(x), atol=1e-6)
