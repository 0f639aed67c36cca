"""Experiment drivers for the Lie-group Bayesian learning rule (not part of the library).

``python -m experiments.runs.train CONFIG.toml`` trains and evaluates one run;
``python -m experiments.runs.compare CONFIG.toml`` trains several runs on the same data and seed
and writes a report folder (Markdown table and figures).
"""
