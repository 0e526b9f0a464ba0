"""Write scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes) as an
ImageFolder: ``<root>/train/<digit>/*.png`` and ``<root>/val/<digit>/*.png`` (fixed, stratified
80/20 split). Offline: the data ships inside scikit-learn.

    python examples/prepare_data.py [root]      # default: data/digits next to examples/
"""
import argparse
import os
import shutil
import sys

DEFAULT_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "digits")


def prepare_digits(root: str = DEFAULT_ROOT, val_fraction: float = 0.2, seed: int = 0) -> str:
    """Create the digits ImageFolder under ``root`` once (a ``.done`` file marks it complete)."""
    done = os.path.join(root, ".done")
    if os.path.isfile(done):
        return root
    try:
        import numpy as np
        from PIL import Image
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        from basetrainer.runtime.errors import MissingExtraError

        raise MissingExtraError(f"preparing the digits data needs scikit-learn and pillow ({e}); "
                                f"run ./setup.sh, or pip install 'basetrainer[dev]'") from None
    images, labels = load_digits(return_X_y=True)
    images = (images.reshape(-1, 8, 8) * (255.0 / 16.0)).round().astype(np.uint8)
    index = np.arange(len(labels))
    train_idx, val_idx = train_test_split(index, test_size=val_fraction, random_state=seed, stratify=labels)
    # built beside root under a name of this process's own, then renamed into place whole: two
    # processes preparing at once (two test workers, two ranks) never see each other's half-written files
    tmp = f"{root}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for split, idx in (("train", train_idx), ("val", val_idx)):
        for i in idx:
            folder = os.path.join(tmp, split, str(labels[i]))
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(images[i], mode="L").save(os.path.join(folder, f"{i:04d}.png"))
    with open(os.path.join(tmp, ".done"), "w") as f:
        f.write(f"{len(train_idx)} train, {len(val_idx)} val\n")
    try:
        os.rename(tmp, root)
    except OSError:
        if not os.path.isfile(done):         # an unfinished folder of an older, interrupted call
            shutil.rmtree(root, ignore_errors=True)
            os.rename(tmp, root)
        else:                                # another process finished first: its folder is the same
            shutil.rmtree(tmp, ignore_errors=True)
    return root


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=DEFAULT_ROOT)
    root = prepare_digits(parser.parse_args().root)
    sys.stdout.write(f"digits ImageFolder ready in {root}\n")
