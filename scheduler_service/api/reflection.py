"""gRPC server reflection that serves the .proto files *with* their doc comments.

The stock grpc_reflection servicer answers from the default descriptor pool, whose descriptors
carry no comments, so `grpcurl describe` would print bare names. This one answers from
FileDescriptorProtos kept with their source info (engine_common.wire.protos), plus grpc.health.v1.

It is served under both service names clients use: grpc.reflection.v1alpha.ServerReflection
(grpcurl <= 1.8.6, most tools) and grpc.reflection.v1.ServerReflection (newer clients); the two
protocols are the same messages on the wire. Requests answered: list_services,
file_by_filename, file_containing_symbol and all_extension_numbers_of_type (always none: the
files are proto3); anything else gets a NOT_FOUND error response.
"""
from __future__ import annotations

from typing import AsyncIterator, Iterable

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from engine_common.wire.protos import documented_file_descriptors

REFLECTION_SERVICES = ("grpc.reflection.v1alpha.ServerReflection",
                       "grpc.reflection.v1.ServerReflection")
_METHOD = "ServerReflectionInfo"


def _plain_proto(file_descriptor) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)
    return proto


def _v1_reflection_proto() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's file under the v1 package name."""
    proto = _plain_proto(rpb.DESCRIPTOR)
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = "grpc.reflection.v1"
    return proto


def default_files() -> list[descriptor_pb2.FileDescriptorProto]:
    """DeltaServe's documented files, grpc.health.v1 and both reflection protocols."""
    return [*documented_file_descriptors().values(), _plain_proto(health_pb2.DESCRIPTOR),
            _plain_proto(rpb.DESCRIPTOR), _v1_reflection_proto()]


def _symbols(file: descriptor_pb2.FileDescriptorProto) -> Iterable[str]:
    """Every fully qualified name a file defines: messages (nested too), their fields, enums and
    enum values (scoped like the enum itself, as protobuf scopes them), services, methods."""
    prefix = f"{file.package}." if file.package else ""

    def enums(scope: str, enum_types) -> Iterable[str]:
        for enum in enum_types:
            yield scope + enum.name
            yield from (scope + value.name for value in enum.value)

    def messages(scope: str, message_types) -> Iterable[str]:
        for msg in message_types:
            name = scope + msg.name
            yield name
            yield from (f"{name}.{f.name}" for f in msg.field)
            yield from (f"{name}.{o.name}" for o in msg.oneof_decl)
            yield from enums(f"{name}.", msg.enum_type)
            yield from messages(f"{name}.", msg.nested_type)

    yield from messages(prefix, file.message_type)
    yield from enums(prefix, file.enum_type)
    for service in file.service:
        yield prefix + service.name
        yield from (f"{prefix}{service.name}.{m.name}" for m in service.method)


class ReflectionServicer:
    """Answers reflection requests from a fixed set of FileDescriptorProtos."""

    def __init__(self, service_names: Iterable[str],
                 files: Iterable[descriptor_pb2.FileDescriptorProto] | None = None):
        self._service_names = tuple(sorted(set(service_names) | set(REFLECTION_SERVICES)))
        self._files = {f.name: f for f in (default_files() if files is None else files)}
        self._file_of_symbol = {sym: f.name for f in self._files.values() for sym in _symbols(f)}

    async def ServerReflectionInfo(self, requests: AsyncIterator[rpb.ServerReflectionRequest],
                                   context) -> AsyncIterator[rpb.ServerReflectionResponse]:
        """One response per request, in order, on one bidirectional stream."""
        async for request in requests:
            yield self.answer(request)

    def answer(self, request: rpb.ServerReflectionRequest) -> rpb.ServerReflectionResponse:
        """The response to one reflection request."""
        kind = request.WhichOneof("message_request")
        if kind == "list_services":
            names = [rpb.ServiceResponse(name=n) for n in self._service_names]
            return rpb.ServerReflectionResponse(
                original_request=request,
                list_services_response=rpb.ListServiceResponse(service=names))
        if kind == "file_by_filename":
            return self._file_response(request, request.file_by_filename)
        if kind == "file_containing_symbol":
            return self._file_response(
                request, self._file_of_symbol.get(request.file_containing_symbol))
        if kind == "all_extension_numbers_of_type":
            name = request.all_extension_numbers_of_type
            if name in self._file_of_symbol:
                return rpb.ServerReflectionResponse(
                    original_request=request,
                    all_extension_numbers_response=rpb.ExtensionNumberResponse(
                        base_type_name=name))
        return _not_found(request, f"{kind or 'request'} not found")

    def _file_response(self, request, file_name: str | None) -> rpb.ServerReflectionResponse:
        if file_name not in self._files:
            return _not_found(request, f"no file defines {file_name or 'that symbol'}")
        ordered = self._with_dependencies(file_name, [])
        return rpb.ServerReflectionResponse(
            original_request=request,
            file_descriptor_response=rpb.FileDescriptorResponse(
                file_descriptor_proto=[self._files[n].SerializeToString() for n in ordered]))

    def _with_dependencies(self, file_name: str, seen: list[str]) -> list[str]:
        """`file_name` first, then every file it imports (transitively, each once)."""
        seen.append(file_name)
        for dep in self._files[file_name].dependency:
            if dep in self._files and dep not in seen:
                self._with_dependencies(dep, seen)
        return seen


def _not_found(request, message: str) -> rpb.ServerReflectionResponse:
    return rpb.ServerReflectionResponse(
        original_request=request,
        error_response=rpb.ErrorResponse(error_code=grpc.StatusCode.NOT_FOUND.value[0],
                                         error_message=message))


def add_reflection(server: grpc.aio.Server, service_names: Iterable[str],
                   files: Iterable[descriptor_pb2.FileDescriptorProto] | None = None) -> None:
    """Serve reflection for `service_names` on `server` under both protocol versions."""
    servicer = ReflectionServicer(service_names, files)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=rpb.ServerReflectionRequest.FromString,
        response_serializer=rpb.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(tuple(
        grpc.method_handlers_generic_handler(name, {_METHOD: handler})
        for name in REFLECTION_SERVICES))
