"""The generated protobuf and gRPC modules, imported from one place.

Everything else imports the stubs from here (`from engine_common.wire.protos import generation_pb2`),
never from `dswire` directly, so the generated package can move without touching callers.
The modules are produced by `python -m engine_common.wire.gen_protos` (the Makefile's `proto` target).
"""
from __future__ import annotations

from google.protobuf import descriptor_pb2

from dswire.v1 import descriptor_set
from dswire.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
# The vendored vLLM engine protocol (packages vllm.grpc.engine and smg.grpc.common).
from dswire.smg import common_pb2 as smg_common_pb2
from dswire.smg import vllm_engine_pb2, vllm_engine_pb2_grpc

__all__ = ["generation_pb2", "generation_pb2_grpc", "worker_pb2", "worker_pb2_grpc",
           "smg_common_pb2", "vllm_engine_pb2", "vllm_engine_pb2_grpc",
           "GENERATION_SERVICE", "WORKER_SERVICE", "VLLM_ENGINE_SERVICE",
           "documented_file_descriptors"]

# Fully qualified service names, as grpc.health.v1 and server reflection spell them.
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
VLLM_ENGINE_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


def documented_file_descriptors() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """Each .proto file's FileDescriptorProto *with* source info (doc comments), by file name.

    The _pb2 modules register descriptors without comments; a reflection service that answers
    with these instead lets `grpcurl describe` print the documentation.
    """
    file_set = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.FILE_DESCRIPTOR_SET)
    return {f.name: f for f in file_set.file}
