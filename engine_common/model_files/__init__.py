"""A model read from disk: a Hugging Face directory's config.json and generation_config.json, or
a GGUF file's header, metadata and tokenizer. Torch-free."""
