"""Continual learning on task streams: the driver, its tuning, the streams, EWC, the report."""
