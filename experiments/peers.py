"""Kept for one release: ``python -m experiments.peers`` is now
``python -m experiments.runs.peers``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.peers", "experiments.runs.peers")
