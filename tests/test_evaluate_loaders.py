"""Which loaders evaluate() takes over 1, 2 and 3 processes: any in one process; in several, only
one that counts each sample once (the test shards of build_dataloader, a DistributedSampler that
does not pad, or a data set it shards itself), so every recorder's figures (AccuracyRecorder,
LossesRecorder, EvalReport's counts) equal one process's; any other loader is refused, naming
the fix. A plain DataLoader(ds, batch_size=6) on 2 processes gave a report of 82 samples for 41."""
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Sampler, SubsetRandomSampler
from torch.utils.data.distributed import DistributedSampler

from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.dataloader.loader import ShardSampler
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from basetrainer.runtime import comm

from conftest import TinyNet, ToyTrainer, blobs, run_distributed, toy_cfg

pytest.importorskip("sklearn.metrics")
from basetrainer.callbacks.eval_report import EvalReport  # noqa: E402


class Pairs(Sampler):
    """A batch sampler of its own: samples two by two, in order."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter([list(range(i, min(i + 2, self.n))) for i in range(0, self.n, 2)])

    def __len__(self):
        return (self.n + 1) // 2


class Stream(IterableDataset):
    """The samples of a data set as a stream."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data[i] for i in range(len(self.data)))


class TwoOutputs(nn.Module):
    """TinyNet's logits and a second output (features): EvalReport and the recorders take the first."""

    def __init__(self):
        super().__init__()
        self.net = TinyNet(4)

    def forward(self, x):
        return self.net(x), x[:, :3] * 2.0


class TwoOutputTrainer(ToyTrainer):
    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        return self.build_model_parallel(TwoOutputs(), cfg.gpu_id, distributed=cfg.distributed)

    def run_step(self, batch):
        x, y = batch
        outputs = self.model(x)
        return outputs, self.criterion(outputs[0], y)


# refused in several processes (any loader is taken in one), and the words that say why
REFUSED = {"plain": "SequentialSampler", "shuffled": "RandomSampler", "subset sampler": "SubsetRandomSampler",
           "padded": "pads 41 samples to 42", "drop_last": "drops each process's last incomplete batch",
           "batch sampler": "batches samples with a Pairs", "iterable": "IterableDataset",
           "plain test loader": "the test loader of build_test_loader"}
ACCEPTED = ("data set", "built", "test loader", "distributed sampler", "two outputs", "2 samples")


def _evaluate_loaders(rank, out_dir):
    world = comm.get_world_size()
    cfg = toy_cfg(n_test=41, batch_size=6, distributed=world > 1, gpu_id=list(range(world)))
    data, data42 = blobs(41, 4, seed=5), blobs(42, 4, seed=6)
    results = {}

    def run(case, loader=None, trainer_class=ToyTrainer, **kwargs):
        # (a report's PNGs take seconds: none for the loaders one process takes and several refuse)
        report = EvalReport(out_dir=os.path.join(out_dir, case.replace(" ", "_")), topk=(1,), tensorboard=False) \
            if world > 1 or case in ACCEPTED else None
        t = trainer_class(cfg, callbacks=[AccuracyRecorder(), LossesRecorder()] + ([report] if report else []))
        if case == "plain test loader":
            t.test_loader = DataLoader(blobs(41, 4, seed=1), batch_size=6)
        if callable(loader):
            loader = loader(t)
        try:
            figures = t.evaluate(loader, **kwargs)
        except ValueError as e:
            results[case] = str(e)
            return
        last = report and report.last_report
        results[case] = {"figures": figures, "report": last and (last["num_samples"], last["confusion_matrix"],
                                                                 last["accuracy"])}

    run("plain", DataLoader(data, batch_size=6))
    run("shuffled", DataLoader(data, batch_size=6, shuffle=True))
    run("subset sampler", DataLoader(data, batch_size=3, sampler=SubsetRandomSampler(range(20))))
    run("padded", DataLoader(data, batch_size=3, sampler=DistributedSampler(data, world, rank, shuffle=False)))
    run("drop_last", DataLoader(data, batch_size=4, sampler=ShardSampler(data, world, rank), drop_last=True))
    run("batch sampler", DataLoader(data, batch_sampler=Pairs(len(data))))
    run("iterable", DataLoader(Stream(data), batch_size=3))
    run("plain test loader")
    run("data set", data)
    run("built", lambda t: t.build_dataloader(data, 6, 0, phase="test", shuffle=False))
    run("test loader")
    run("distributed sampler",
        DataLoader(data42, batch_size=2, sampler=DistributedSampler(data42, world, rank, seed=3)))
    run("two outputs", data, trainer_class=TwoOutputTrainer)
    run("2 samples", blobs(2, 4, seed=7), batch_size=3)   # 3 processes: one holds no sample
    if world > 1:   # training: EvalReport checks the test loader at on_train_begin, with the same rule
        t = ToyTrainer(cfg, callbacks=[EvalReport(out_dir=os.path.join(out_dir, "run"), tensorboard=False)])
        t.test_loader = DataLoader(blobs(41, 4, seed=1), batch_size=6)
        try:
            t.run()
            results["run"] = "no error"
        except ValueError as e:
            results["run"] = str(e)
    return results


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _evaluate_loaders(0, str(tmp_path_factory.mktemp("one")))   # this process: every loader taken


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("procs", [2, 3])
def test_evaluate_counts_each_sample_once_or_refuses_the_loader_over_2_and_3_processes(tmp_path, procs, one_process):
    one = one_process
    sizes = {"data set": 41, "built": 41, "test loader": 41, "distributed sampler": 42, "two outputs": 41,
             "2 samples": 2}
    assert {case: one[case]["report"][0] for case in ACCEPTED} == sizes
    assert all(isinstance(one[case]["figures"]["test/Accuracy"], float) for case in REFUSED if case != "drop_last")
    # one process refuses drop_last too where it leaves samples out (41 = 10 x 4 + 1)
    assert "drops its last incomplete batch (drop_last=True), so 1 of its 41 samples would not count" in one["drop_last"]
    ranks = run_distributed(_evaluate_loaders, procs, tmp_path, str(tmp_path / "many"), timeout=400)
    for rank, result in enumerate(ranks):
        for case, why in REFUSED.items():
            assert isinstance(result[case], str), (case, result[case])
            assert why in result[case] and "phase='test'" in result[case], (case, result[case])
        for case in ACCEPTED:
            figures, want = result[case]["figures"], one[case]["figures"]
            assert figures["test/Accuracy"] == want["test/Accuracy"], case                # counts: exact
            assert figures["test/loss"] == pytest.approx(want["test/loss"], rel=1e-6, abs=0), case
            if rank == 0:   # the report: the same samples, counted once
                assert result[case]["report"] == one[case]["report"], case
        assert result["run"].startswith("EvalReport: the test loader: the loader draws samples with a "
                                        "SequentialSampler") and "phase='test'" in result["run"]
    assert ranks[0]["plain"].startswith(f"evaluate(loader): the loader draws samples with a SequentialSampler, "
                                        f"which is not sharded over the processes")


def test_one_process_refuses_a_sampler_sharded_for_other_processes():
    t = ToyTrainer(toy_cfg(n_test=41, batch_size=6), callbacks=[AccuracyRecorder()])
    data = blobs(42, 4, seed=6)
    for sampler in (DistributedSampler(data, num_replicas=2, rank=0), ShardSampler(data, num_replicas=2, rank=1)):
        with pytest.raises(ValueError, match=rf"evaluate\(loader\): its {type(sampler).__name__} is shard \d of 2, "
                                             rf"and this is process 0 of 1.*phase='test'"):
            t.evaluate(DataLoader(data, batch_size=3, sampler=sampler))
    with pytest.raises(ValueError, match=r"DistributedSampler cuts 42 samples to 40"):
        t.evaluate(DataLoader(data, batch_size=3,
                              sampler=DistributedSampler(data, num_replicas=4, rank=0, drop_last=True)))
    # a data set with no batch_size in the config: evaluate(batch_size=) builds its loader
    t.cfg.batch_size = None
    assert t.evaluate(blobs(41, 4, seed=5), batch_size=6)["test/Accuracy"] == \
        t.evaluate(DataLoader(blobs(41, 4, seed=5), batch_size=5))["test/Accuracy"]


def test_one_process_evaluates_an_iterable_dataset_with_the_progress_bar_on():
    """ProgressBar asked len() of the test loader, which an IterableDataset without __len__ lacks:
    TypeError in ProgressBar.on_test_begin."""
    t = ToyTrainer(toy_cfg(n_test=41, batch_size=6, progress=True), callbacks=[AccuracyRecorder(), LossesRecorder()])
    data = blobs(41, 4, seed=5)
    streamed = t.evaluate(DataLoader(Stream(data), batch_size=3))
    assert streamed == pytest.approx(t.evaluate(DataLoader(data, batch_size=3)), rel=1e-12)
    assert 0 < streamed["test/Accuracy"] < 1
