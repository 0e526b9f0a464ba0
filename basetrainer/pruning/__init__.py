"""Structured pruning: :func:`basetrainer.pruning.nni_pruning.model_pruning` removes channels
(torch-pruning by default, NNI optional); :class:`basetrainer.pruning.slim.SlimRegularizer`
trains BatchNorm scales sparse for ``prune_type="slim"``."""
