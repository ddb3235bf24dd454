"""The tiny GPT-OSS checkpoint: its tokenizer, its writer and `quantreg tiny-model`."""
