"""Patches of torch.distributed and gloo (see elastictrain/compat/__init__.py)."""
