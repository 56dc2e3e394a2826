"""The tokenizer side: validation, tokenization, request tracking, detokenization."""
