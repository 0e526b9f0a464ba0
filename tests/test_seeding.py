"""Per-sample seeding (dataloader/seeding.py): every item is drawn with each generator it uses
seeded from (seed, epoch, index), though numpy's and python's are seeded only once seen in use."""
import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from basetrainer.dataloader import seeding


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


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(seeding, "_GENERATORS", None)   # as in a new worker: nothing seen in use yet


def test_every_item_is_drawn_from_generators_seeded_by_its_key(fresh):
    data = seeding.SeededDataset(Mixed(), seed=7)
    keys = [(i, 3) for i in reversed(range(30))]           # any order: the draws depend on the key only
    got = data.__getitems__(keys)
    assert got == [reference(i, 3) for i, _ in keys]
    assert seeding._generators().seeded == {"numpy": True, "python": True}   # both were seen in use


def test_a_pipeline_drawing_from_torch_only_seeds_torch_only(fresh):
    class TorchOnly(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return float(torch.rand(()))

    data = seeding.SeededDataset(TorchOnly(), seed=7)
    data.__getitems__([(i, 0) for i in range(10)])
    assert seeding._generators().seeded == {"numpy": False, "python": False}


def test_the_main_process_keeps_its_own_draws(fresh):
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expected = (float(torch.rand(())), random.random(), float(np.random.rand()))
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    seeding.SeededDataset(Mixed(), seed=7).__getitems__([(i, 0) for i in range(30)])
    assert (float(torch.rand(())), random.random(), float(np.random.rand())) == expected


def test_the_generators_can_be_watched_here():
    # where they cannot, they are seeded for every sample (slower, as exact): say which way it runs
    generators = seeding._Generators()
    assert all(watch is not None for watch in generators.watches.values())
