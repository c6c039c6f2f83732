"""Runs inside a worker actor: the actor, its attempt, model, data, LoRA and user code."""
