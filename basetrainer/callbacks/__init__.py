"""Callbacks: the base class (:mod:`.callbacks`), recorders, logging, checkpoints, progress."""
