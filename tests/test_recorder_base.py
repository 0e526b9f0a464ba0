"""The recorder base (basetrainer.callbacks.recorder): a recorder that states only what it counts
is exact over 3 ranks holding uneven shards (one of them no test sample at all) and across a
resume inside an epoch; the reduction in one place adds what an idle rank lacks."""
import os

import pytest
import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.callbacks.losses_recorder import RunningSums
from basetrainer.callbacks.recorder import Recorder, sum_over_ranks
from basetrainer.runtime import comm

from conftest import StopAt, ToyTrainer, run_distributed, toy_cfg


class FirstLogit(Recorder):
    """The sample-weighted mean of the first logit: the whole recorder, on the base."""

    def new_counts(self, phase):
        return RunningSums()

    def update(self, counts, inputs, outputs, losses):
        counts.add({self.indicator: outputs[:, 0].sum()}, len(inputs[1]), per_sample=False)

    def compute(self, counts, reduce):
        return counts.means(reduce)


class Capture(Callback):
    """Every step's first logit per (epoch, phase), on the CPU."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self.seen.setdefault((epoch, "train"), []).append(outputs[:, 0].detach().cpu().clone())

    def on_test_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self.seen.setdefault((epoch, "test"), []).append(outputs[:, 0].detach().cpu().clone())


def _train(work, extra=(), resume=""):
    # 85 train samples, global batch 21 (7 a rank): the last step holds 1 sample, on one rank;
    # 2 test samples: the third rank tests nothing
    cfg = toy_cfg(n_train=85, n_test=2, batch_size=21, num_epochs=2, lr=0.05, work_dir=work, resume=resume,
                  distributed=comm.get_world_size() > 1)
    ckpt = ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="logit0", save_freq_steps=1,
                           async_save=False)
    return ToyTrainer(cfg, callbacks=[FirstLogit("logit0"), ckpt, *extra]).run().epochs


def _runs(rank, work):
    capture = Capture()
    full = _train(os.path.join(work, "full"), [capture])
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        _train(os.path.join(work, "cut"), [StopAt(1, 2)])
    comm.synchronize()   # rank 0 has written the step's last.pth
    resumed = _train(os.path.join(work, "cut"), resume="auto")
    # the reduction itself: keys only some ranks hold, integer and float dtypes, gathered objects
    sums = {"float": torch.full((2,), float(rank + 1))}
    if rank != 2:
        sums["int"] = torch.tensor([rank, 10], dtype=torch.long)
    if rank == 1:
        sums["only_one"] = torch.tensor(7.0)
    summed, shared = sum_over_ranks(sums, shared=f"rank{rank}")
    return {"full": full, "resumed": resumed, "seen": capture.seen, "summed": summed, "shared": shared}


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    work = tmp_path_factory.mktemp("three")
    return run_distributed(_runs, 3, work, str(work), timeout=300)


@pytest.mark.distributed
def test_a_recorder_on_the_base_is_exact_over_three_uneven_ranks(three):
    for epoch in range(2):
        for phase, n in (("train", 85), ("test", 2)):
            steps = [three[r]["seen"].get((epoch, phase), []) for r in range(3)]
            values = torch.cat([v for rank in steps for v in rank])
            assert len(values) == n
            if phase == "test":
                assert [sum(len(v) for v in rank) for rank in steps] == [1, 1, 0]   # rank 2 tests nothing
            for rank in three:   # every rank holds the whole data set's figure
                assert rank["full"][epoch][f"{phase}/logit0"] == pytest.approx(float(values.double().mean()),
                                                                               rel=1e-5, abs=1e-6), (epoch, phase)


@pytest.mark.distributed
def test_a_recorder_on_the_base_resumed_inside_an_epoch_counts_every_step_once(three):
    for rank in three:
        assert [r["epoch"] for r in rank["resumed"]] == [1]
        for phase in ("train", "test"):
            assert rank["resumed"][0][f"{phase}/logit0"] == pytest.approx(rank["full"][1][f"{phase}/logit0"],
                                                                          rel=1e-6, abs=1e-7), phase


@pytest.mark.distributed
def test_sum_over_ranks_adds_what_an_idle_rank_lacks_and_gathers_in_rank_order(three):
    for rank in three:
        summed, shared = rank["summed"], rank["shared"]
        assert summed["float"].tolist() == [6.0, 6.0]
        assert summed["int"].dtype == torch.long and summed["int"].tolist() == [1, 20]   # exact integers
        assert summed["only_one"].item() == 7.0
        assert shared == ["rank0", "rank1", "rank2"]


def test_one_process_keeps_the_tensors_and_a_recorder_missing_a_hook_names_it():
    t = torch.tensor([1.0, 2.0])
    summed, shared = sum_over_ranks({"a": t, "none": None}, shared="x")
    assert summed == {"a": t} and summed["a"] is t and shared == ["x"]

    class Half(Recorder):
        def new_counts(self, phase):
            return RunningSums()

    with pytest.raises(NotImplementedError, match="Half must define update"):
        Half("x").update(None, None, None, None)
