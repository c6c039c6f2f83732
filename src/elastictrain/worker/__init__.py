"""The worker actor's lifecycle: attempt set-up and teardown, steps, validation, in-memory snapshots."""
