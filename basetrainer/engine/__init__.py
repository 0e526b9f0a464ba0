"""The training loop (:mod:`.engine`), its checkpointer (:mod:`.checkpointer`: the run's position,
saves, restores) and how a run starts (:mod:`.resume`), the trainer with its build hooks
(:mod:`.trainer`), and process launch (:mod:`.launch`). Process-group helpers are in
:mod:`basetrainer.runtime.comm`."""
