"""Test doubles and fault injection: the fake worker group the control loop's unit tests drive, and the
worker subclass tests, benchmarks and chaos runs use to crash, hang or slow a real worker. Never used by
a production run."""
