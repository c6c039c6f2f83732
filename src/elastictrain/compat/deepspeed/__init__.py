"""Patches of DeepSpeed's internals (see elastictrain/compat/__init__.py)."""
