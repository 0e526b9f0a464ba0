"""Hyperparameter search over the config keys of an unchanged trainer script (Optuna underneath).

    python -m basetrainer.tune examples/example.py --space configs/search.yaml --trials 12 [script args]

Each trial is an ordinary run of the script in ``work_dir/trials/<n>/``: the search names a YAML
of the trial's keys in the ``BASETRAINER_TRIAL`` environment variable, ``parser_config`` applies it
over the script's own config, and the trainer adds :class:`~basetrainer.callbacks.tune_report.TuneReport`,
which reports the objective each epoch and stops the run (every rank, the same epoch) when the
pruner says so. The study lives in ``work_dir/study.db`` (SQLite): rerunning the command after a
kill continues it and retries the interrupted trial. See docs/tune.md.
"""
