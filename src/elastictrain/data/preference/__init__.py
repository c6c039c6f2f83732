"""Preference data (DPO-style pairs, KTO examples) from the record shapes users keep."""
