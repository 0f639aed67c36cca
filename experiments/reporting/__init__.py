"""The documentation's quoted numbers from committed result summaries."""
