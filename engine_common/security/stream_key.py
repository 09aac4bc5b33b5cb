"""The per-epoch Step stream key of the Worker protocol: its metadata name and size.

The worker token lets a caller read the owner's epoch from Info; a Step stream of that epoch
used to supersede the owner's and inherit its requests and KV cache (another tenant's data).
So each epoch has a secret only the caller that started it learns (InitResponse/ResetResponse
.stream_key), and every Step stream presents it as this metadata (docs/security.md, "The
epoch's stream key"). A `-bin` key: gRPC sends its value as raw bytes (base64 on the wire).
"""
from __future__ import annotations

STREAM_KEY_METADATA = "deltaserve-stream-key-bin"
STREAM_KEY_BYTES = 32


def stream_key_metadata(key: bytes) -> tuple[tuple[str, bytes], ...]:
    """The Step call's metadata carrying `key` (nothing when empty: the worker refuses it)."""
    return ((STREAM_KEY_METADATA, key),) if key else ()
