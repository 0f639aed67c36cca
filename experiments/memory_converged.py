"""Kept for one release: ``python -m experiments.memory_converged`` is now
``python -m experiments.memory.converged``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.memory_converged", "experiments.memory.converged")
