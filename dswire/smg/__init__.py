"""Generated protobuf and gRPC modules of the vendored vLLM engine protocol (proto/dswire/smg,
from smg-grpc-proto 0.4.28): packages `vllm.grpc.engine` and `smg.grpc.common`.

Do not edit the modules here; run `make proto`. Import them through `engine_common.wire.protos`.
"""
