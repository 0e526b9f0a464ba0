"""Per-sample seeding (dataloader/seeding.py): every item is drawn with each generator it uses
seeded from (seed, epoch, index), though numpy's and python's are seeded only once seen in use."""
import ast
import inspect
import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from basetrainer.dataloader import seeding
from basetrainer.dataloader.loader import build_dataloader


class Mixed(Dataset):
    """torch for every sample; python's random for some, numpy for others (data-dependent use)."""

    def __len__(self):
        return 30

    def __getitem__(self, i):
        x = float(torch.rand(()))
        if i % 3 == 2:
            x += random.random()
        if i % 5 == 4:
            x += float(np.random.rand())
        return x


def reference(i, epoch):
    s = seeding.sample_seed(7, epoch, i)
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s & 0xFFFFFFFF)
    return Mixed()[i]


def test_every_item_is_drawn_from_generators_seeded_by_its_key():
    data = seeding.SeededDataset(Mixed(), seed=7)
    keys = [(i, 3) for i in reversed(range(30))]           # any order: the draws depend on the key only
    got = data.__getitems__(keys)
    assert got == [reference(i, 3) for i, _ in keys]
    assert data.generators.seeded == {"torch": True, "numpy": True, "python": True}   # all seen in use


def test_a_pipeline_drawing_from_torch_only_seeds_torch_only():
    class TorchOnly(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return float(torch.rand(()))

    data = seeding.SeededDataset(TorchOnly(), seed=7)
    data.__getitems__([(i, 0) for i in range(10)])
    assert data.generators.seeded == {"torch": True, "numpy": False, "python": False}


def test_the_main_process_keeps_its_own_draws():
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expected = (float(torch.rand(())), random.random(), float(np.random.rand()))
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    seeding.SeededDataset(Mixed(), seed=7).__getitems__([(i, 0) for i in range(30)])
    assert (float(torch.rand(())), random.random(), float(np.random.rand())) == expected


def test_generators_first_used_inside_a_batch_are_seeded_for_its_earlier_items_too():
    data = seeding.SeededDataset(Mixed(), seed=7)
    keys = [(i, 1) for i in range(30)]          # python's is first used by item 2, numpy's by item 4
    assert data.__getitems__(keys) == [reference(i, 1) for i, _ in keys]


class Nothing(Dataset):
    """An in-memory data set: draws from no generator; reports torch's initial seed."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.initial_seed()


def test_a_data_set_that_draws_nothing_seeds_only_torch_and_sees_its_sample_seed():
    data = seeding.SeededDataset(Nothing(), seed=7)
    got = data.__getitems__([(i, 2) for i in range(10)])
    assert got == [seeding.sample_seed(7, 2, i) for i in range(10)]    # torch.initial_seed() is the sample's
    assert data.generators.seeded == {"torch": True, "numpy": False, "python": False}


def test_a_generator_made_from_torch_initial_seed_draws_as_documented():
    class OwnRng(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return float(np.random.default_rng(torch.initial_seed()).random())

    got = seeding.SeededDataset(OwnRng(), seed=7).__getitems__([(i, 4) for i in range(10)])
    assert got == [float(np.random.default_rng(seeding.sample_seed(7, 4, i)).random()) for i in range(10)]


class Gaussians(Dataset):
    """Gaussian draws of every generator (each caches a second value)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return float(torch.randn(())) + random.gauss(0, 1) + float(np.random.standard_normal())


def test_the_main_process_keeps_its_cached_gaussians_too():
    def main_draws():
        return float(torch.randn(())), random.gauss(0, 1), float(np.random.standard_normal())

    def seed_and_cache():
        torch.manual_seed(3)
        random.seed(3)
        np.random.seed(3)
        main_draws()          # each generator now holds a cached second gaussian

    seed_and_cache()
    expected = main_draws()
    seed_and_cache()
    seeding.SeededDataset(Gaussians(), seed=7).__getitems__([(i, 0) for i in range(8)])   # seen in use here
    assert main_draws() == expected
    seed_and_cache()
    seeding.SeededDataset(Gaussians(), seed=7).__getitems__([(i, 1) for i in range(8)])   # seeded throughout
    assert main_draws() == expected


def test_the_generators_are_reached_through_their_public_functions_only():
    # no ctypes over torch's, numpy's or python's objects: their layouts change without notice
    tree = ast.parse(inspect.getsource(seeding))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "ctypes" not in imported, sorted(imported)


class Augment(Dataset):
    """What a transform draws from each global generator, per sample (numpy's for some only)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        draws = (float(torch.rand(())), float(np.random.rand()) if i % 4 == 3 else 0.0, random.random())
        return torch.tensor([i, *draws], dtype=torch.float64)


def epoch_draws(workers, start=0):
    """{index: its draws} of epoch 2 of the default loader, started at global batch ``start`` (a
    resume inside the epoch) with ``workers`` worker processes."""
    loader = build_dataloader(Augment(), 8, workers, phase="train", seed=11)
    loader.batch_sampler.set_epoch(2)
    loader.batch_sampler.start_at(start)
    rows = torch.cat(list(loader))
    return {int(r[0]): r[1:].tolist() for r in rows}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_draws_what_the_uninterrupted_one_drew(workers):
    full = epoch_draws(0)
    resumed = epoch_draws(workers, start=3)          # batches 3 and 4 of 5, in fresh worker processes
    assert len(full) == 40 and len(resumed) == 16
    assert all(full[i][2] == random.Random(seeding.sample_seed(11, 2, i)).random() for i in full)   # the sample's
    assert resumed == {i: full[i] for i in resumed}
    assert epoch_draws(workers) == full               # the whole epoch, any workers
