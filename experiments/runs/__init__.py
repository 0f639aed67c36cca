"""Runs of a config: one run, runs compared over seeds, tuning, post-hoc Laplace beside them."""
