"""In-memory snapshots, the worker side: take them, replicate to the buddy, serve peers, load a new attempt.

The plan (who backs up whom, which snapshot a restart loads) is core/snapshot_plan.py; the driver side
is control/snapshot_schedule.py (which steps) and control/memory_recovery.py (where a restart loads from).
"""
