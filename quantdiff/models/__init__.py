"""Models: loading local checkpoints, names (built-in pair, directories), structure, matched pairs, tokenizer."""
