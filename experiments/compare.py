"""Kept for one release: ``python -m experiments.compare`` is now
``python -m experiments.runs.compare``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.compare", "experiments.runs.compare")
