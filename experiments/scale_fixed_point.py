"""Kept for one release: ``python -m experiments.scale_fixed_point`` is now
``python -m experiments.rules.scale_fixed_point``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.scale_fixed_point", "experiments.rules.scale_fixed_point")
