"""Pure decisions of elastictrain: no ray, deepspeed, torch or mlflow imports here.

Time and randomness come in as arguments, so every rule has a fast unit test.
"""
