"""Kept for one release: ``python -m experiments.docs_tables`` is now
``python -m experiments.reporting.docs_tables``, which this runs."""

if __name__ == "__main__":
    from experiments.common import cli

    cli.alias("experiments.docs_tables", "experiments.reporting.docs_tables")
