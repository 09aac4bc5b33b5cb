"""Text <-> token ids: the tokenizer and streaming detokenizer, the tiny test tokenizer, chat
templates rendered in a sandbox."""
