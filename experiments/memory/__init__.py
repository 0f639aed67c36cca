"""Memory maps checked by retraining, against converged retraining, and model selection
by the estimated leave-one-out NLL, with their scores, statistics, figures and reports."""
