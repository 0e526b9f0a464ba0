"""basetrainer.callbacks.callbacks.batch_size_of: the number of samples of a batch, whatever its
shape (the recorders weight losses by it, LogHistory counts samples/s with it)."""
import pytest
import torch

from basetrainer.callbacks.callbacks import batch_size_of


def images(n, channels=3):
    """``n`` image tensors of different sizes (a detection batch cannot stack them)."""
    return [torch.zeros(channels, 8 + i, 10 - i) for i in range(n)]


def targets(n):
    return [{"boxes": torch.zeros(i + 1, 4), "labels": torch.zeros(i + 1, dtype=torch.long)} for i in range(n)]


@pytest.mark.parametrize("batch,expected", [
    (torch.zeros(5, 3), 5),                                                       # a tensor: dim 0
    (torch.tensor(2.0), 1),
    ([torch.zeros(5, 3, 8, 8), torch.zeros(5, dtype=torch.long)], 5),             # default collate
    ((torch.zeros(6, 2), torch.zeros(6, 2)), 6),                                  # equal shapes (x, x)
    ((torch.zeros(4, 3), torch.zeros(5)), 4),                                     # no agreement: the first
    ((torch.zeros(4, 3), torch.tensor(1.0)), 4),                                  # a scalar beside
    ((tuple(images(4)), tuple(targets(4))), 4),                                   # detection: zip(*batch)
    ((images(2, channels=5), targets(2)), 2),                                     # lists of images
    (([torch.zeros(7, 2), torch.zeros(7, 9)], torch.zeros(7)), 7),                # a multi-input model
    ((torch.zeros(7, 2), (torch.zeros(7), torch.zeros(7, 4))), 7),                # several targets
    ({"image": torch.zeros(6, 3, 4, 4), "label": torch.zeros(6)}, 6),             # a dict: first value
    ({"images": images(4), "targets": targets(4)}, 4),
    ((torch.zeros(3, 2), torch.zeros(3), ["a.png", "b.png", "c.png"]), 3),        # paths beside
])
def test_batch_size_of_counts_samples(batch, expected):
    assert batch_size_of(batch) == expected


def test_batch_size_of_without_a_tensor_names_the_type():
    with pytest.raises(TypeError, match="cannot find a tensor in the batch to count its samples"):
        batch_size_of(["a", "b"])
