"""Patches of MLflow's internals (see elastictrain/compat/__init__.py)."""
