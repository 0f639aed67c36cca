"""What every driver stands on: configs, data, models, optimizers, the run skeleton,
the training loop and one run (``training``), evaluation, figures, run files, the command line."""
