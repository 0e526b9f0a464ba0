"""basetrainer.engine.trainer: the documented pattern ``super().__init__(cfg); self.build(cfg)``
works whatever object ``cfg`` is (a Config, a plain dict, an argparse Namespace)."""
import argparse

import pytest
import torch

from basetrainer.engine import trainer as trainer_mod
from basetrainer.utils import setup_config
from basetrainer.utils.setup_config import Config
from conftest import ToyTrainer, toy_cfg


class DocumentedTrainer(ToyTrainer):
    """ToyTrainer's hooks, built the way EngineTrainer's docstring shows: with the caller's cfg."""

    def __init__(self, cfg):
        trainer_mod.EngineTrainer.__init__(self, cfg)
        self._extra, self._model = [], None
        self.build(cfg)


def _weights(t):
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


@pytest.mark.parametrize("kind", ["dict", "namespace"])
def test_documented_pattern_with_a_plain_dict_or_namespace(kind):
    values = dict(toy_cfg(num_epochs=2, n_train=64))
    assert "num_workers" not in values and "scheduler" not in values   # left to the defaults
    given = dict(values) if kind == "dict" else argparse.Namespace(**values)
    t = DocumentedTrainer(given)
    history = t.run()
    reference = ToyTrainer(toy_cfg(num_epochs=2, n_train=64))
    reference.run()
    # the hooks saw a Config holding the caller's values and the defaults, and trained alike
    assert isinstance(t.cfg, Config) and t.cfg.batch_size == 16 and t.cfg.num_workers == 0
    assert t.num_steps == 4 and len(history) == 2
    for key, value in _weights(reference).items():
        assert torch.equal(_weights(t)[key], value), key
    # the defaults show through the caller's own object too
    get = given.get if kind == "dict" else lambda key: getattr(given, key)
    assert (get("num_workers"), get("scheduler"), get("batch_size")) == (0, "multi-step", 16)


def test_build_with_another_config_uses_that_one():
    t = ToyTrainer(toy_cfg(n_train=64))
    t.build(setup_config.with_defaults(toy_cfg(n_train=32)))
    assert t.num_samples == 32 and t.num_steps == 2
