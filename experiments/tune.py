"""Kept for one release: ``python -m experiments.tune`` is now
``python -m experiments.runs.tune``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.tune", "experiments.runs.tune")
