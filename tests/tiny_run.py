"""The command-line options of a tiny training run (seconds on a CPU), shared by the tests that train."""

TINY_MODEL = ["--dim", "16", "--layers", "1", "--heads", "2", "--max-len", "20", "--batch-size", "64"]
TINY_MODEL += ["--negatives", "32", "--device", "cpu"]
"""A model and batch small enough for a test, on the CPU; no data source, no verbosity."""

TINY = ["--data", "synthetic", *TINY_MODEL, "--quiet"]
"""A tiny model trained quietly on the synthetic data."""
