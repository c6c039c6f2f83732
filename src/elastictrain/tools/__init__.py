"""Offline tools on committed checkpoints: reshard, export of weights and adapters."""
