"""The error every LoRA refusal raises (re-exported by adapter.py, where callers import it)."""
from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the adapter and what is wrong."""
