"""Kept for one release: ``python -m experiments.log_g_walk`` is now
``python -m experiments.rules.log_g_walk``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.log_g_walk", "experiments.rules.log_g_walk")
