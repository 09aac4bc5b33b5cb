"""The step protocol on the wire: the diff and reply types, their msgpack codec, new block ids as
varints, and the generated stubs (`protos`, the one module that imports `dswire`)."""
