"""The training loop (:mod:`.engine`), the trainer with its build hooks (:mod:`.trainer`),
process launch (:mod:`.launch`) and distributed helpers (:mod:`.comm`)."""
