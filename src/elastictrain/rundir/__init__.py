"""The run folder: run.json, events.jsonl, config.yaml, durable writes, driver liveness."""
