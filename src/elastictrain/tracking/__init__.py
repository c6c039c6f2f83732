"""Experiment tracking: the tracker protocol, MLflow, and the spool that survives an outage."""
