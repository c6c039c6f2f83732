"""The run's model inside a worker: building it (your factory, a local folder or a config), transformers'
initialization under ZeRO-3, LoRA adapters, and the built-in loss."""
