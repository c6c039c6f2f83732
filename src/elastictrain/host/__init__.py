"""The host a worker runs on: how much memory it has and gives back, and background threads' CPU priority."""
