"""Configuration, logging, files and torch helpers."""
