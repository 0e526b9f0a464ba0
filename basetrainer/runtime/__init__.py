"""The bottom layer: process-group helpers (:mod:`.comm`), files written atomically
(:mod:`.atomic`), the run's checkpoints (:mod:`.checkpoint`), the run folder's rules
(:mod:`.run_folder`), model unwrapping (:mod:`.modules`) and the user errors (:mod:`.errors`). Imports nothing of basetrainer."""
