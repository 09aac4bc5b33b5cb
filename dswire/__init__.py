"""The wire: protobuf and gRPC modules generated from proto/dswire/ by `make proto`.

The bottom package of the tree: it imports nothing of ours, and everything above reaches it through
`engine_common.wire.protos`. Only the Python package is named `dswire`; the proto packages inside
(`deltaserve.v1`, `vllm.grpc.engine`, `smg.grpc.common`), and so every service, RPC path and
message name on the wire, keep their names.
"""
