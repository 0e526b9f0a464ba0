"""Using a trained model: per-sample outputs gathered over the ranks in dataset order
(:mod:`~basetrainer.evaluation.ordered`), streamed to files (:mod:`~basetrainer.evaluation.writers`),
and the evaluation report of a classifier (:mod:`~basetrainer.evaluation.report`)."""
