"""Data pipelines beyond the built-in sources: instruction records (sft/)."""
