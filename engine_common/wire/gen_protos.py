"""Generate the Python protobuf and gRPC modules from `proto/` (run from the repository root).

    python -m engine_common.wire.gen_protos            # writes dswire/{v1,smg}/*_pb2*.py(i)
    python -m engine_common.wire.gen_protos --out DIR  # writes DIR/dswire/v1/... (staleness test)

Messages made of declared settings (engine_common/configuration/settings.py) are written into the .proto sources
first, between BEGIN/END GENERATED markers (`render_declared_messages`): the declaration in
engine_common/configuration/config.py is their one source.

The sources are compiled with `-I proto`, so the modules are named after their folder
(`dswire.v1.generation_pb2`) and import each other absolutely; nothing is rewritten afterwards.
The folder names only the Python package (`dswire`, the bottom of the tree): the proto packages
inside, and so the wire, stay `deltaserve.v1`, `vllm.grpc.engine` and `smg.grpc.common`.

Generated gRPC stubs refuse to load under a grpcio older than the grpcio-tools that produced them,
so they are generated with the oldest grpcio we deploy against (`GRPC_TOOLS_VERSION`).
"""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from engine_common.configuration.settings import proto_message

# The grpcio-tools release the committed stubs come from. Stubs it writes load under grpcio >= this.
GRPC_TOOLS_VERSION = "1.84.0"
REPO_ROOT = Path(__file__).resolve().parents[2]   # engine_common/wire/gen_protos.py
PROTO_ROOT = REPO_ROOT / "proto"
# Ours, then the vendored vLLM engine protocol of the Shepherd Model Gateway (proto/dswire/smg).
PROTO_FILES = ("dswire/v1/generation.proto", "dswire/v1/worker.proto",
               "dswire/smg/common.proto", "dswire/smg/vllm_engine.proto")
# What protoc writes per .proto stem, relative to the output root.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# The FileDescriptorSet *with* source info (doc comments), as a Python bytes literal. The _pb2
# modules drop comments, so server reflection serves these to show them in `grpcurl describe`.
DESCRIPTOR_SET_MODULE = "dswire/v1/descriptor_set.py"
_BYTES_PER_LINE = 64
# .proto file -> the messages generated into it from a config class ("module:Class").
DECLARED_MESSAGES = {
    "dswire/v1/worker.proto": (("WorkerConfig", "engine_common.configuration.config:WorkerConfig"),),
}
_BEGIN = "// BEGIN GENERATED {name}: `make proto` writes it from {source}."
_END = "// END GENERATED {name}"


class GrpcToolsVersionError(RuntimeError):
    """The installed grpcio-tools is missing or not the pinned release."""


def installed_grpc_tools_version() -> str | None:
    """The installed grpcio-tools version, or None when it is not installed."""
    try:
        return metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        return None


def check_grpc_tools() -> None:
    """Raise GrpcToolsVersionError unless grpcio-tools == GRPC_TOOLS_VERSION is installed."""
    found = installed_grpc_tools_version()
    if found != GRPC_TOOLS_VERSION:
        raise GrpcToolsVersionError(
            f"grpcio-tools=={found} is installed; the stubs must come from "
            f"grpcio-tools=={GRPC_TOOLS_VERSION} so that they load under grpcio>={GRPC_TOOLS_VERSION}: "
            f"pip install grpcio-tools=={GRPC_TOOLS_VERSION}")


def generated_paths() -> list[str]:
    """Paths (relative to the output root) of every generated module, sorted."""
    stems = [f.removesuffix(".proto") for f in PROTO_FILES]
    paths = [stem + suffix for stem in stems for suffix in GENERATED_SUFFIXES]
    return sorted(paths + [DESCRIPTOR_SET_MODULE])


def render_declared_messages(proto_file: str, text: str) -> str:
    """`text` (a .proto source) with each generated block rewritten from its declarations."""
    for name, source in DECLARED_MESSAGES.get(proto_file, ()):
        module, cls = source.split(":")
        body = proto_message(getattr(importlib.import_module(module), cls), name)
        begin = _BEGIN.format(name=name, source=module.replace(".", "/") + ".py")
        block = f"{begin}\n{body}\n{_END.format(name=name)}"
        pattern = re.compile(rf"// BEGIN GENERATED {name}:.*?{re.escape(_END.format(name=name))}",
                             re.S)
        if not pattern.search(text):
            raise ValueError(f"{proto_file} has no BEGIN/END GENERATED {name} markers")
        text = pattern.sub(lambda _: block, text)
    return text


def update_proto_sources() -> None:
    """Rewrite the generated blocks of the .proto sources where they changed."""
    for proto_file in DECLARED_MESSAGES:
        path = PROTO_ROOT / proto_file
        text = path.read_text()
        new = render_declared_messages(proto_file, text)
        if new != text:
            path.write_text(new)


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Compile every .proto under PROTO_ROOT into `out_dir`; returns the files written. Writing
    into the repository first brings the declared messages of the sources up to date."""
    check_grpc_tools()
    if out_dir.resolve() == REPO_ROOT:
        update_proto_sources()
    out = str(out_dir)
    _protoc(f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}")
    with tempfile.TemporaryDirectory() as tmp:
        set_path = Path(tmp) / "descriptor_set.binpb"
        _protoc("--include_source_info", f"--descriptor_set_out={set_path}")
        (out_dir / DESCRIPTOR_SET_MODULE).write_text(_bytes_module(set_path.read_bytes()))
    return [out_dir / p for p in generated_paths()]


def _protoc(*options: str) -> None:
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", str(PROTO_ROOT), *options,
           *(str(PROTO_ROOT / f) for f in PROTO_FILES)]
    subprocess.run(cmd, check=True)


def _bytes_module(data: bytes) -> str:
    """Python source holding `data` as FILE_DESCRIPTOR_SET, split into short lines."""
    chunks = [data[i:i + _BYTES_PER_LINE] for i in range(0, len(data), _BYTES_PER_LINE)]
    body = "".join(f"    {chunk!r}\n" for chunk in chunks)
    return ("# Generated by engine_common/wire/gen_protos.py from proto/. DO NOT EDIT!\n"
            '"""FileDescriptorSet of every .proto under proto/, with source info (comments)."""\n'
            f"FILE_DESCRIPTOR_SET = (\n{body})\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT,
                        help="output root (default: the repository root)")
    args = parser.parse_args(argv)
    try:
        written = generate(args.out)
    except GrpcToolsVersionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
