"""Sampling: the sampler's inputs staged from the batch, its per-step metadata, logits -> tokens,
grammar masks for structured output, and the tokens read back to the host."""
