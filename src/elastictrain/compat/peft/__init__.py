"""Patches of peft's internals (see elastictrain/compat/__init__.py)."""
