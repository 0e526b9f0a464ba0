"""The folder-of-images data set that predict() will run over: a fixed order, and a clear error
for a file that is not an image."""
import os

import pytest
import torch
from torchvision import transforms

from basetrainer.dataloader.image_files import ImageFiles
from basetrainer.dataloader.loader import build_dataloader

from conftest import make_image_folder


def test_images_in_a_fixed_order_with_their_index(tmp_path):
    root = make_image_folder(str(tmp_path / "imgs"), ["b", "a"], per_class=3)
    (tmp_path / "imgs" / ".DS_Store").write_bytes(b"\0")
    os.makedirs(tmp_path / "imgs" / ".ipynb_checkpoints")
    (tmp_path / "imgs" / ".ipynb_checkpoints" / "x.txt").write_text("x")
    data = ImageFiles(root, transform=transforms.ToTensor())
    assert [data.relative(i) for i in range(len(data))] == [f"{c}/{i}.png" for c in "ab" for i in range(3)]
    image, index = data[4]
    assert index == 4 and image.shape == (3, 8, 8)
    batches = list(build_dataloader(data, 4, phase="test", shuffle=False))
    assert torch.cat([i for _, i in batches]).tolist() == list(range(6))
    with pytest.raises(ValueError, match="holds no image"):
        ImageFiles(root, recursive=False)          # the images are in subfolders


def test_a_file_that_is_not_an_image_is_refused_naming_it(tmp_path):
    root = make_image_folder(str(tmp_path / "imgs"), ["a"], per_class=2)
    (tmp_path / "imgs" / "a" / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.txt' is not an image file.*move it out"):
        ImageFiles(root)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFiles(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="holds no image"):
        ImageFiles(str(tmp_path / "empty"))


def test_a_damaged_image_names_its_file_when_loaded(tmp_path):
    root = make_image_folder(str(tmp_path / "imgs"), ["a"], per_class=1)
    (tmp_path / "imgs" / "a" / "broken.png").write_bytes(b"not a png")
    data = ImageFiles(root)
    with pytest.raises(OSError, match="broken.png"):
        data[0 if data.paths[0].endswith("broken.png") else 1]


def test_one_image_file(tmp_path):
    root = make_image_folder(str(tmp_path / "imgs"), ["a"], per_class=1)
    data = ImageFiles(os.path.join(root, "a", "0.png"))
    assert len(data) == 1 and data[0][1] == 0
