"""Class imbalance, and what ``balance`` does about it: the bundled digits with some classes cut
to a tenth of their training images, trained once per ``balance`` value (same seed, same
epochs), each evaluated on the full validation set by EvalReport (per-class recall, balanced
accuracy: ``<work_dir>/<balance>/eval/``).

    python examples/imbalanced.py                              # balance none and sqrt, CPU
    python examples/imbalanced.py --balances none mean log sqrt --num_epochs 6 --gpu_id 0

The other flags are examples/example.py's (--net_type, --input_size, --lr, ...).
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from example import ClassificationTrainer, get_parser  # noqa: E402
from prepare_data import DEFAULT_ROOT, prepare_digits  # noqa: E402

from basetrainer.callbacks.eval_report import EvalReport  # noqa: E402
from basetrainer.dataloader.image_folder import image_folder  # noqa: E402
from basetrainer.runtime import errors  # noqa: E402
from basetrainer.utils import setup_config  # noqa: E402


def cut_classes(dataset, minority, keep):
    """Keep the first ``keep`` fraction (at least one) of the images of each ``minority`` class."""
    kept, seen = [], {}
    per_class = {c: sum(1 for _, t in dataset.samples if t == c) for c in range(len(dataset.classes))}
    for path, target in dataset.samples:
        if target in minority:
            limit = max(1, round(per_class[target] * keep))
            if seen.get(target, 0) >= limit:
                continue
            seen[target] = seen.get(target, 0) + 1
        kept.append((path, target))
    dataset.samples = dataset.imgs = kept
    dataset.targets = [t for _, t in kept]
    return dataset


class ImbalancedTrainer(ClassificationTrainer):
    def build_train_loader(self, cfg, **kwargs):
        dataset = image_folder(cfg.train_data, transform=self.transforms(cfg, train=True), key="train_data")
        cfg.num_classes, cfg.classes = len(dataset.classes), dataset.classes
        minority = {dataset.classes.index(str(c)) for c in cfg.minority}
        cut_classes(dataset, minority, cfg.keep)
        self.class_counts = {dataset.classes[c]: dataset.targets.count(c) for c in range(len(dataset.classes))}
        return self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="train", shuffle=True,
                                     drop_last=True, distributed=cfg.distributed)   # balance: the config's key

    def build_callbacks(self, cfg, **kwargs):
        self.report = EvalReport(out_dir=os.path.join(cfg.work_dir, "eval"), class_names=cfg.classes, topk=(1, 2))
        return super().build_callbacks(cfg, **kwargs) + [self.report]


def main(argv=None):
    parser = get_parser()
    parser.add_argument("--balances", nargs="+", default=["none", "sqrt"], choices=list(setup_config.BALANCE_CHOICES),
                        help="the balance values to compare, one run each")
    parser.add_argument("--minority", nargs="+", default=["0", "1", "2"], help="classes cut to --keep of their images")
    parser.add_argument("--keep", type=float, default=0.1, help="fraction of a minority class's images kept")
    args = parser.parse_args(argv)
    if args.eval_only or args.predict:   # example.py's flags: one run's, not this comparison's
        parser.error("--eval_only and --predict take one trained run: python examples/example.py --eval_only "
                     "--resume auto --work_dir <work_dir>/imbalanced/balance_<value> (and this run's other flags)")
    balances = args.balances
    base = setup_config.parser_config(args, cfg_updata=True, parser=parser, argv=argv)
    if not base.train_data:   # the bundled digits, made on first use
        root = prepare_digits(DEFAULT_ROOT)
        base.train_data = os.path.join(root, "train")
        base.test_data = base.test_data or os.path.join(root, "val")
    base.work_dir = os.path.join(base.work_dir, "imbalanced")
    results = {}
    for balance in balances:
        cfg = setup_config.Config({k: v for k, v in base.to_dict().items() if k != "balances"})
        cfg.balance = balance
        cfg.work_dir = os.path.join(base.work_dir, f"balance_{balance}")
        trainer = ImbalancedTrainer(cfg)
        trainer.run()
        report = trainer.report.last_report
        results[balance] = {"train_counts": trainer.class_counts, "accuracy": report["accuracy"],
                            "balanced_accuracy": report["balanced_accuracy"],
                            "recall": {name: row["recall"] for name, row in report["per_class"].items()}}
    names = list(next(iter(results.values()))["recall"])
    lines = ["| balance | " + " | ".join(f"recall {n}" for n in names) + " | accuracy | balanced accuracy |",
             "|---" * (len(names) + 3) + "|"]
    for balance, r in results.items():
        lines.append(f"| {balance} | " + " | ".join(f"{r['recall'][n]:.3f}" for n in names)
                     + f" | {r['accuracy']:.4f} | {r['balanced_accuracy']:.4f} |")
    table = "\n".join(lines)
    print(f"train images per class: {next(iter(results.values()))['train_counts']}\n{table}", flush=True)
    os.makedirs(base.work_dir, exist_ok=True)
    with open(os.path.join(base.work_dir, "imbalanced.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    with errors.exit_on_usage_error():   # a user error: "error: <message>", exit status 2, no traceback
        main()
