"""Patches of transformers' internals (see elastictrain/compat/__init__.py)."""
