"""Kept for one release: ``python -m experiments.continual_tune`` is now
``python -m experiments.continual.tune``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.continual_tune", "experiments.continual.tune")
