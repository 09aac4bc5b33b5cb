"""Device code: attention backends, KV-cache writes and fused helpers. Imports torch."""
