"""Data loaders whose order depends only on (seed, epoch), and checked image folders."""
