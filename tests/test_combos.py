"""Where features meet: the engine's promises checked on a generated set of configs that holds
every pair of levels of two factors (:mod:`combos`: strategy, data shape, workers, precision,
accumulation, clipping, EMA, model, balance, compile, resume, callbacks), with the invariants of
:mod:`combo_checks`. A failure names the config, the invariant, and the command that reruns
that config alone. ``BASETRAINER_COMBO_SEED=<n>`` draws another set (exploring)."""
import os
import time

import pytest

from combo_checks import check, ranks_report, run_all
from combos import FACTORS, REFUSED, coverage, generate

SEED = int(os.environ.get("BASETRAINER_COMBO_SEED", "0"))
REPORT = os.environ.get("BASETRAINER_COMBO_REPORT")   # a JSON file: times and measured differences
COMBOS = generate(SEED)


def test_the_set_covers_every_pair_and_the_core():
    covered, total = coverage(COMBOS)
    assert covered == total, f"{total - covered} pairs of levels in no config"
    runs = [c for c in COMBOS if not c.refusal()]
    for strategy in FACTORS["strategy"]:
        for model in FACTORS["model"]:
            same = [c for c in runs if (c.strategy, c.model) == (strategy, model)]
            assert {c.ema for c in same} == {False, True}, (strategy, model)
            assert {c.precision for c in same} == {"fp32", "bf16"}, (strategy, model)
    assert len([c for c in COMBOS if c.refusal()]) == len(REFUSED)
    assert [c.levels() for c in generate(SEED)] == [c.levels() for c in COMBOS]   # deterministic


def test_a_failed_config_reports_every_ranks_error_and_the_stacks_of_a_rank_that_ran_on(tmp_path):
    """The job's stderr ends with the last rank's traceback; the rank that hung (and made the
    others time out) is named only by what each rank left (combos._rank_main)."""
    import torch

    combo = next(c for c in COMBOS if c.world == 3)
    folder = tmp_path / combo.cid
    folder.mkdir()
    torch.save({"error": "RuntimeError: Timed out waiting 120000ms (rank 0)"}, folder / "run-rank0.pt")
    torch.save({"error": "RuntimeError: Timed out waiting 120000ms (rank 1)"}, folder / "run-rank1.pt")
    (folder / "run-rank0.stacks.txt").write_text("")
    (folder / "run-rank2.stacks.txt").write_text('File "loader.py", line 7 in __next__\n')
    report = ranks_report(str(tmp_path), combo, "run")
    assert "rank 0 failed:\nRuntimeError: Timed out waiting 120000ms (rank 0)" in report
    assert "rank 1 failed:\nRuntimeError: Timed out waiting 120000ms (rank 1)" in report
    assert 'rank 2 was still running after 90 s:\nFile "loader.py", line 7 in __next__' in report
    assert "rank 0 was still running" not in report   # an empty file: it finished in time


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = os.environ.get("BASETRAINER_COMBO_ROOT") or str(tmp_path_factory.mktemp("combos"))   # kept: for a look
    start = time.perf_counter()
    state = run_all(COMBOS, root, SEED)
    state["root"], state["wall"] = root, time.perf_counter() - start
    return state


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("combo", COMBOS, ids=[f"{c.cid}-{c.describe()}" for c in COMBOS])
def test_promises_hold(runs, combo):
    failures, measured = check(combo, runs["root"], runs["errors"])
    if REPORT:
        _report(combo, failures, measured, runs)
    rerun = f"python tests/combos.py --seed {SEED} --config {combo.cid}"
    assert not failures, (f"config {combo.cid} ({combo.describe()}) breaks:\n  " + "\n  ".join(failures)
                          + f"\nrerun it alone: {rerun}\nmeasured: {measured}")


def _report(combo, failures, measured, runs):
    import json

    try:
        with open(REPORT, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError):
        report = {}
    report.setdefault("configs", {})[combo.cid] = {"levels": combo.describe(), "failures": failures,
                                                   "measured": measured}
    report["times"], report["wall"], report["seed"] = runs["times"], runs["wall"], SEED
    with open(REPORT, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
