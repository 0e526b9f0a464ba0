"""The bottom layer: process-group helpers (:mod:`.comm`), files written atomically
(:mod:`.atomic`), the run's checkpoints (:mod:`.checkpoint`), the run folder's rules
(:mod:`.run_folder`) and model unwrapping (:mod:`.modules`). Imports nothing of basetrainer."""
