"""Checkpoint format and storage: rank files, the commit protocol, verification, reading fragments."""
