"""basetrainer.utils.setup_config: precedence, warnings, types, round trips, defaults, and the
(seed, epoch)-only train order."""
import argparse
import copy
import logging
import pickle

import pytest
import torch

from basetrainer.utils import setup_config
from basetrainer.utils.setup_config import Config
from conftest import ToyTrainer, blobs, toy_cfg


@pytest.fixture(autouse=True)
def _propagate(monkeypatch):
    """log.set_logger (called by other tests) stops propagation; caplog listens at the root."""
    monkeypatch.setattr(logging.getLogger("basetrainer"), "propagate", True)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config_file", default=None)
    p.add_argument("-b", "--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--num_epochs", type=int, default=5)
    p.add_argument("--gpu_id", nargs="*", type=int, default=[0])
    p.add_argument("--distributed", action="store_true")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    return p


def write_yaml(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


YAML = """\
batch_size: 16
lr: 0.2
gpu_id: [1, 2]
distributed: false
progress: true
net_type: mobilenet_v2
"""


# ------------------------------------------------------------------------------ precedence
def test_precedence_with_parser_default_lt_yaml_lt_typed(tmp_path):
    cfg_file = write_yaml(tmp_path, YAML)
    parser = make_parser()
    argv = ["-c", cfg_file, "--lr", "0.3", "-b", "8", "--gpu_id", "--distributed", "--no-progress"]
    cfg = setup_config.parser_config(parser.parse_args(argv), cfg_updata=True, parser=parser, argv=argv)
    assert cfg.lr == 0.3                  # typed beats YAML
    assert cfg.batch_size == 8            # typed (short option, equal to the default) beats YAML's 16
    assert cfg.gpu_id == []               # typed with no values
    assert cfg.distributed is True        # store_true typed
    assert cfg.progress is False          # --no-progress typed
    assert cfg.num_epochs == 5            # argparse default, not in YAML
    assert cfg.net_type == "mobilenet_v2"  # YAML only
    assert cfg.config_file == cfg_file


def test_precedence_with_parser_yaml_beats_argparse_defaults(tmp_path):
    cfg_file = write_yaml(tmp_path, YAML)
    parser = make_parser()
    argv = ["--config_file", cfg_file]
    cfg = setup_config.parser_config(parser.parse_args(argv), parser=parser, argv=argv)  # cfg_updata=True default
    assert (cfg.batch_size, cfg.lr, cfg.gpu_id, cfg.num_epochs) == (16, 0.2, [1, 2], 5)


@pytest.mark.parametrize("argv", [["--lr", "0.3"], ["--lr=0.3"], ["--l", "0.3"]])
def test_precedence_without_parser_from_argv(tmp_path, argv):
    cfg_file = write_yaml(tmp_path, YAML)
    full = ["--config_file", cfg_file] + argv
    args = make_parser().parse_args(full)
    cfg = setup_config.parser_config(args, cfg_updata=True, argv=full)
    assert (cfg.lr, cfg.batch_size, cfg.gpu_id, cfg.num_epochs) == (0.3, 16, [1, 2], 5)


def test_precedence_without_parser_from_sys_argv(tmp_path, monkeypatch):
    cfg_file = write_yaml(tmp_path, YAML)
    argv = ["--config_file", cfg_file, "--batch_size", "8", "--no-progress"]
    monkeypatch.setattr("sys.argv", ["train.py"] + argv)
    cfg = setup_config.parser_config(make_parser().parse_args(), cfg_updata=True)
    assert cfg.batch_size == 8       # typed, though equal to the argparse default
    assert cfg.progress is False     # --no-<name> found as <name>
    assert cfg.lr == 0.2             # YAML over the argparse default


def test_abbreviated_flag_without_parser_is_typed(tmp_path, monkeypatch):
    # argparse accepts a unique prefix (--batch for --batch_size): it is still a typed flag
    cfg_file = write_yaml(tmp_path, YAML)
    argv = ["--config_file", cfg_file, "--batch", "8", "--num_ep", "5"]
    monkeypatch.setattr("sys.argv", ["train.py"] + argv)
    cfg = setup_config.parser_config(make_parser().parse_args(), cfg_updata=True)
    assert (cfg.batch_size, cfg.num_epochs, cfg.lr) == (8, 5, 0.2)


def _config_of(args):
    """parser_config called from a frame that holds no parser (its caller's frame does)."""
    return setup_config.parser_config(args, cfg_updata=True)


def test_short_option_without_parser_uses_the_callers_parser(tmp_path, monkeypatch):
    cfg_file = write_yaml(tmp_path, "batch_size: 32\nlr: 0.2\n")
    monkeypatch.setattr("sys.argv", ["train.py", "-c", cfg_file, "-b", "64"])
    parser = make_parser()   # the script's parser, as in DESIGN.md's snippet; not passed
    cfg = setup_config.parser_config(parser.parse_args(), cfg_updata=True)
    assert (cfg.batch_size, cfg.lr) == (64, 0.2)   # typed -b beats the YAML; YAML beats the default
    # found in a caller further out too, and exactly (-b 8 equals the argparse default)
    monkeypatch.setattr("sys.argv", ["train.py", "-c", cfg_file, "-b", "8"])
    assert _config_of(parser.parse_args()).batch_size == 8


def test_typed_options_that_cannot_be_matched_without_a_parser_are_named(tmp_path, monkeypatch, caplog):
    cfg_file = write_yaml(tmp_path, "batch_size: 32\nlr: 0.2\n")
    argv = ["-c", cfg_file, "-b", "64", "--lr", "0.3", "--gpu_id", "-1", "--bs=3"]
    monkeypatch.setattr("sys.argv", ["train.py"] + argv)
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        cfg = setup_config.parser_config(make_parser().parse_known_args()[0], cfg_updata=True)
    assert (cfg.batch_size, cfg.lr, cfg.gpu_id) == (32, 0.3, [-1])   # -b unknown: the YAML's value stays
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for flag in ("'-b'", "'--bs=3'"):
        assert sum(flag in w for w in warned) == 1, (flag, warned)
    # '--lr' is matched, '-1' is a value, and '-c' is followed by the config file's own path
    assert all("parser=" in w for w in warned) and len(warned) == 2, warned


def test_cfg_updata_false_argparse_values_win(tmp_path):
    cfg_file = write_yaml(tmp_path, YAML)
    argv = ["--config_file", cfg_file]
    parser = make_parser()
    cfg = setup_config.parser_config(parser.parse_args(argv), cfg_updata=False, parser=parser, argv=argv)
    assert (cfg.batch_size, cfg.lr, cfg.gpu_id) == (8, 0.1, [0])  # argparse values, not YAML's
    assert cfg.net_type == "mobilenet_v2"                          # YAML keys argparse lacks still come through


def test_no_config_file_gives_argparse_values_and_defaults():
    cfg = setup_config.parser_config(make_parser().parse_args([]), argv=[])
    assert (cfg.batch_size, cfg.lr, cfg.config_file) == (8, 0.1, None)
    assert cfg.seed == 2020 and cfg.scheduler == "multi-step"


def test_dict_args_are_accepted(tmp_path):
    cfg_file = write_yaml(tmp_path, "batch_size: 4\n")
    cfg = setup_config.parser_config({"config_file": cfg_file, "lr": 0.5}, argv=[])
    assert isinstance(cfg, Config)
    assert (cfg.batch_size, cfg.lr) == (4, 0.5)


# ------------------------------------------------------------------------------ warnings / errors
def test_unknown_yaml_key_warns_with_closest_known_key(tmp_path, caplog):
    cfg_file = write_yaml(tmp_path, "bach_size: 4\nmy_own_key: 3\nlr: 0.2\n")
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        cfg = setup_config.parser_config(make_parser().parse_args(["-c", cfg_file]), argv=["-c", cfg_file])
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    typo = [m for m in messages if "'bach_size'" in m]
    assert len(typo) == 1 and "did you mean 'batch_size'" in typo[0]
    own = [m for m in messages if "'my_own_key'" in m]
    assert len(own) == 1 and "did you mean" not in own[0]
    assert not any("'lr'" in m for m in messages)
    # unknown keys are kept (scripts may add keys of their own), the known one is untouched
    assert (cfg.bach_size, cfg.my_own_key, cfg.batch_size, cfg.lr) == (4, 3, 8, 0.2)


@pytest.mark.parametrize("text,key,value,expected", [
    ('batch_size: "32"\n', "batch_size", "'32'", "an integer"),
    ("input_size: [32]\n", "input_size", "[32]", "two positive integers"),
    ("lr: fast\n", "lr", "'fast'", "a number"),
    ("gpu_id: [0, a]\n", "gpu_id", "[0, 'a']", "a list of integers"),
    ("distributed: 'yes'\n", "distributed", "'yes'", "true or false"),
    ("num_epochs: 2.5\n", "num_epochs", "2.5", "an integer"),
])
def test_wrong_yaml_type_names_key_value_and_type(tmp_path, text, key, value, expected):
    cfg_file = write_yaml(tmp_path, text)
    with pytest.raises(TypeError) as info:
        setup_config.parser_config({"config_file": cfg_file}, argv=[])
    msg = str(info.value)
    assert f"'{key}'" in msg and value in msg and expected in msg


def test_gpu_id_int_becomes_list():
    cfg = Config(gpu_id=0)
    setup_config.validate(cfg)
    assert cfg.gpu_id == [0]


def test_yaml_that_does_not_parse_names_line_and_column(tmp_path):
    cfg_file = write_yaml(tmp_path, "a: 1\n  b: 2\n")
    with pytest.raises(ValueError) as info:
        setup_config.load_config(cfg_file)
    msg = str(info.value)
    assert "line 2, column 4" in msg and "not valid YAML" in msg and cfg_file in msg
    cfg_file = write_yaml(tmp_path, "batch_size: 8\nmilestones: [1, 2\nlr: 0.1\n", "b.yaml")
    with pytest.raises(ValueError, match=r"line 3, column 3"):
        setup_config.parser_config({"config_file": cfg_file}, argv=[])


def test_yaml_not_a_mapping_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="mapping of keys to values, got list"):
        setup_config.load_config(write_yaml(tmp_path, "- 1\n- 2\n"))
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        setup_config.parser_config({"config_file": missing}, argv=[])
    assert setup_config.load_config(write_yaml(tmp_path, "", "empty.yaml")) == {}


# ------------------------------------------------------------------------------ Config object
def test_save_load_round_trip(tmp_path):
    cfg = Config(train_data=["a/train", "b/train"], input_size=[32, 24], lr=0.05, gpu_id=[], finetune="",
                 resume=None, distributed=True, milestones=[3, 5], nested={"x": 1, "y": [1.5, "z"]},
                 classes=["cat", "dog"])
    path = setup_config.save_config(cfg, str(tmp_path / "out" / "setup_config.yaml"))
    assert path == str(tmp_path / "out" / "setup_config.yaml")
    loaded = setup_config.load_config(path)
    assert loaded == cfg
    assert isinstance(loaded, Config) and isinstance(loaded.nested, Config)
    assert loaded.nested.y == [1.5, "z"]
    # key order kept (sort_keys=False)
    assert list(loaded) == list(cfg)


def test_save_config_writes_non_plain_values_as_text(tmp_path):
    ns = argparse.Namespace(device=torch.device("cpu"), t=(1, 2))
    path = setup_config.save_config(ns, str(tmp_path / "c.yaml"))
    assert setup_config.load_config(path) == {"device": "cpu", "t": [1, 2]}


def test_config_access_assignment_pickle_deepcopy():
    cfg = Config(lr=0.1, sub={"a": 1})
    assert cfg.lr == cfg["lr"] == 0.1
    cfg.new_key = 3
    cfg["other"] = {"b": 2}
    assert cfg["new_key"] == 3 and cfg.other.b == 2 and isinstance(cfg.other, Config)
    assert cfg.sub.a == 1
    with pytest.raises(AttributeError, match="config has no key 'missing'"):
        cfg.missing  # noqa: B018
    del cfg.new_key
    assert "new_key" not in cfg
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and type(back) is Config and type(back.sub) is Config and back.sub.a == 1
    deep = copy.deepcopy(cfg)
    deep.sub.a = 99
    assert cfg.sub.a == 1 and deep == {**cfg, "sub": {"a": 99}}
    assert cfg.setdefault("lr", 5) == 0.1 and cfg.setdefault("z", {"q": 1}).q == 1
    assert cfg.to_dict() == {"lr": 0.1, "sub": {"a": 1}, "other": {"b": 2}, "z": {"q": 1}}
    assert type(cfg.to_dict()["sub"]) is dict


# ------------------------------------------------------------------------------ defaults
def test_with_defaults_fills_every_engine_key():
    cfg = Config(batch_size=4, my_key="x")
    out = setup_config.with_defaults(cfg)
    assert out is cfg
    for key, (default, _, _) in setup_config.ENGINE_KEYS.items():
        if key != "batch_size":
            assert cfg[key] == default, key
    assert (cfg.batch_size, cfg.my_key) == (4, "x")
    seed_keys = ["train_data", "test_data", "work_dir", "net_type", "input_size", "batch_size", "lr",
                 "optim_type", "loss_type", "scheduler", "milestones", "momentum", "num_epochs", "num_warn_up",
                 "num_workers", "weight_decay", "gpu_id", "log_freq", "finetune", "use_prune", "progress",
                 "distributed"]
    assert set(seed_keys) <= set(setup_config.ENGINE_KEYS)
    # defaults are copies: mutating one config's list does not change the next one's
    cfg.milestones.append(1000)
    assert setup_config.with_defaults(Config()).milestones == [30, 60, 90]


def test_with_defaults_converts_dict_and_namespace():
    assert isinstance(setup_config.with_defaults({"lr": 0.5}), Config)
    ns = setup_config.with_defaults(argparse.Namespace(lr=0.5))
    assert isinstance(ns, Config) and ns.lr == 0.5 and ns.num_epochs == 100


def test_toy_trainer_with_minimal_config(tmp_path, monkeypatch):
    # the default work_dir is ./work_space: not the one README's first command trains the example in
    monkeypatch.chdir(tmp_path)
    cfg = Config(num_epochs=1, progress=False)   # everything else from the engine defaults
    t = ToyTrainer(cfg)
    assert t.cfg is cfg and cfg.seed == 2020 and cfg.batch_size == 32 and cfg.gpu_id == [0]
    assert str(t.device) == "cpu" and t.num_steps == 4 and t.num_samples == 128  # 128 blobs / 32
    before = [p.detach().clone() for p in t.model.parameters()]
    history = t.run()
    assert len(history) == 1 and history.last["epoch"] == 0
    assert t.global_step == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))


# ------------------------------------------------------------------------------ train order
def _order(seed: int, epoch: int, **kw) -> list:
    t = ToyTrainer(toy_cfg(seed=seed, batch_size=16, n_train=40, **kw))
    t.set_epoch(epoch)
    torch.manual_seed(12345 + epoch)  # the global RNG must not matter
    xs = torch.cat([x for x, _ in t.train_loader])
    data = blobs(40, 4, seed=0).tensors[0]
    # map each row back to its index in the data set
    return [int((data == row).all(dim=1).nonzero()[0]) for row in xs]


def test_train_order_depends_only_on_seed_and_epoch():
    a0, a1 = _order(7, 0), _order(7, 1)
    assert _order(7, 0) == a0 and _order(7, 1) == a1     # same (seed, epoch) -> same order
    assert a0 != a1                                      # another epoch reshuffles
    assert _order(8, 0) != a0                            # another seed differs
    assert sorted(a0) == list(range(40))                 # a permutation: every sample once
    # exactly the permutation drawn from (seed + epoch)
    assert a0 == torch.randperm(40, generator=torch.Generator().manual_seed(7 + 0)).tolist()
    assert a1 == torch.randperm(40, generator=torch.Generator().manual_seed(7 + 1)).tolist()


def test_train_order_via_sampler_set_epoch():
    t1 = ToyTrainer(toy_cfg(seed=3, n_train=40))
    t2 = ToyTrainer(toy_cfg(seed=3, n_train=40))
    for epoch in (0, 1, 2):
        t1.train_loader.batch_sampler.set_epoch(epoch)
        t2.train_loader.batch_sampler.set_epoch(epoch)
        assert list(t1.train_loader.batch_sampler) == list(t2.train_loader.batch_sampler)
    t1.train_loader.batch_sampler.set_epoch(0)
    first = list(t1.train_loader.batch_sampler)
    t1.train_loader.batch_sampler.set_epoch(2)
    assert list(t1.train_loader.batch_sampler) != first


def test_train_loader_without_shuffle_is_in_order():
    assert _order(7, 1, shuffle=False) == list(range(40))
