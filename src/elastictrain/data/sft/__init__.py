"""`data.source: sft`: instruction records (alpaca, sharegpt, openai) as (input_ids, labels) samples."""
