"""Where a run's samples come from: generated text, a text file, Hugging Face datasets on local files, token
shards and their index, instruction records (sft/), and the held-out split for validation."""
