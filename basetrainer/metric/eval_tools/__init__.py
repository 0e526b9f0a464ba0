"""The original's evaluation tools (``basetrainer.metric.eval_tools`` of basetrainer 1.0.4), with
their names and arguments, on scikit-learn, torchmetrics and matplotlib (extra ``eval``):

- :mod:`.classification_report`: per-class precision/recall/F1, confusion matrices;
- :mod:`.roc`, :mod:`.pr`, :mod:`.acc`: ROC and precision-recall curves with their AUC,
  accuracy against a threshold;
- :mod:`.verification`: face-verification accuracy and TAR at a FAR over k folds;
- :mod:`.metrics`: ``AverageMeter`` and top-k ``accuracy``.

Plots are drawn on matplotlib's Agg canvas (no window, no change to pyplot's backend) and
returned as figures; given a ``filename`` they are written there as PNG.
"""
