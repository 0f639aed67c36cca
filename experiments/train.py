"""Kept for one release: ``python -m experiments.train`` is now
``python -m experiments.runs.train``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.train", "experiments.runs.train")
