"""Generated protobuf and gRPC modules of the `deltaserve.v1` package (from proto/dswire/v1).

Do not edit the modules here; run `make proto`. Import them through `engine_common.wire.protos`.
"""
