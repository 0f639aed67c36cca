"""Kept for one release: ``python -m experiments.continual`` is now
``python -m experiments.continual.learn``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.continual", "experiments.continual.learn")
