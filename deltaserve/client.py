"""`deltaserve generate`: stream one completion from a running scheduler to the terminal.

The text goes to stdout as it arrives; the finish reason and token counts go to stderr at the end.
Torch-free: grpc, the generated stubs and the sampling knobs (engine_common.request.params).
"""
from __future__ import annotations

import argparse
import math
import sys

import grpc
from google.protobuf.descriptor import FieldDescriptor

from engine_common.security.grpc_metadata import with_metadata
from engine_common.request.params import KNOBS, ParamError
from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import generation_pb2_grpc


def build_request(args) -> pb.GenerateRequest:
    """A GenerateRequest from the `generate` subcommand's flags."""
    req = pb.GenerateRequest()
    if args.token_ids:
        try:
            ids = [int(t) for t in args.token_ids.split(",")]
        except ValueError:
            raise ParamError("--token-ids", args.token_ids, "comma-separated token ids") from None
        for t in ids:
            _check_fits(req, "token_ids", t, "--token-ids")
        req.token_ids.extend(ids)
    elif args.prompt is not None:
        req.text = args.prompt
    else:       # said here, not by the server after a round trip
        raise ParamError("prompt", "none given", "a prompt text (the argument) or --token-ids")
    set_options(req, args)
    return req


# The knobs with a flag: those declared with help for one (engine_common/request/params.py).
FLAG_KNOBS = tuple(k for k in KNOBS if k.meta.help)


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """--temperature, --top-p, ...: one flag per declared knob that has a help text."""
    for k in FLAG_KNOBS:
        p.add_argument("--" + k.name.replace("_", "-"), type=int if k.meta.integer else float,
                       default=None, help=k.meta.help)


# What each protobuf integer type holds: protobuf itself refuses more with a bare ValueError
# ("Value out of range"), a traceback out of the CLI.
_INT_RANGES = {FieldDescriptor.CPPTYPE_INT32: (-2**31, 2**31 - 1),
               FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
               FieldDescriptor.CPPTYPE_INT64: (-2**63, 2**63 - 1),
               FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1)}


def _check_fits(msg, name: str, value, flag: str) -> None:
    """ParamError naming `flag` unless msg's integer field `name` can hold `value` (the server
    checks the rest, naming the field)."""
    bounds = _INT_RANGES.get(msg.DESCRIPTOR.fields_by_name[name].cpp_type)
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise ParamError(flag, value, f"an integer in [{bounds[0]}, {bounds[1]}]")


def _set_flag(msg, name: str, value, flag: str) -> None:
    _check_fits(msg, name, value, flag)
    setattr(msg, name, value)


def set_options(req: pb.GenerateRequest, args) -> None:
    """Sampling and stopping fields from the flags the subcommand has (unset ones stay unset);
    ParamError naming the flag for a value its field cannot hold, or a --timeout that is no
    deadline (0 or less, or inf, failed at once as DEADLINE_EXCEEDED; NaN meant none)."""
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not 0 < timeout < math.inf:
        raise ParamError("--timeout", timeout, "a finite number of seconds > 0")
    for k in FLAG_KNOBS:
        value = getattr(args, k.name, None)
        if value is not None:
            _set_flag(req.sampling, k.name, value, "--" + k.name.replace("_", "-"))
    _set_flag(req.stopping, "max_tokens", args.max_tokens, "--max-tokens")
    _set_flag(req.stopping, "min_tokens", getattr(args, "min_tokens", 0), "--min-tokens")
    req.stopping.stop.extend(getattr(args, "stop", []))
    req.stopping.ignore_eos = getattr(args, "ignore_eos", False)


def warn_if_chat_model(stub, req: pb.GenerateRequest, timeout: float | None) -> None:
    """One warning on stderr when a raw-text prompt goes to a model that has a chat template
    (an instruct model answers such text badly, often with nothing at all)."""
    if not req.HasField("text"):
        return
    try:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout or 10)
    except grpc.RpcError:
        return      # the Generate call reports an unreachable server
    if info.has_chat_template:
        print(f"warning: {info.model_name} has a chat template, but this prompt is raw text and "
              "is sent as is; for a chat, use `deltaserve chat \"...\"` (or "
              "GenerateRequest.messages)", file=sys.stderr, flush=True)


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """--cacert and --api-key-file, for a server with TLS and API keys."""
    p.add_argument("--cacert", default=None, metavar="FILE",
                   help="PEM CA certificate: connect with TLS and verify the server against it")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="send the key on this file's first line as `authorization: Bearer`")


def open_channel(args) -> grpc.Channel:
    """A channel to args.target: plaintext, or TLS verified against --cacert; every call
    carries the API key of --api-key-file when given."""
    if getattr(args, "cacert", None):
        with open(args.cacert, "rb") as f:
            channel = grpc.secure_channel(args.target, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(args.target)
    path = getattr(args, "api_key_file", None)
    if not path:
        return channel
    with open(path) as f:
        return with_metadata(channel, (("authorization", f"Bearer {f.readline().strip()}"),))


def generate(args) -> int:
    """Run the stream; 0 on a finished request, 1 on a gRPC error."""
    with open_channel(args) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = build_request(args)
        warn_if_chat_model(stub, request, args.timeout)
        last = None
        try:
            for resp in stub.Generate(request, timeout=args.timeout):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                last = resp
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(flush=True)
    if last is not None:
        reason = pb.FinishReason.Name(last.finish_reason)
        stop = last.WhichOneof("stop_reason")
        detail = f" ({stop}={getattr(last, stop)!r})" if stop else ""
        print(f"[finish_reason={reason}{detail} prompt_tokens={last.usage.prompt_tokens} "
              f"completion_tokens={last.usage.completion_tokens}]", file=sys.stderr)
    return 0
