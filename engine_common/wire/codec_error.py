"""The step codec's one error type, apart so that the codec and its sampling part
(engine_common/wire/sampling_wire.py) both raise it without importing each other."""


class CodecError(ValueError):
    """A payload that does not decode to the expected layout."""
