"""Kept for one release: ``python -m experiments.memory_loo`` is now
``python -m experiments.memory.loo``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.memory_loo", "experiments.memory.loo")
