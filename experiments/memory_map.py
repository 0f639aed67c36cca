"""Kept for one release: ``python -m experiments.memory_map`` is now
``python -m experiments.memory.maps``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.memory_map", "experiments.memory.maps")
