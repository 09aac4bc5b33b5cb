"""Credentials on both services' ports: TLS material, the worker protocol's token and mutual TLS,
a channel that adds metadata (a token, an API key) to every call."""
