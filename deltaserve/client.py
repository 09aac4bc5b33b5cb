"""`deltaserve generate`: stream one completion from a running scheduler to the terminal.

The text goes to stdout as it arrives; the finish reason and token counts go to stderr at the end.
Torch-free: only grpc and the generated stubs.
"""
from __future__ import annotations

import sys

import grpc

from engine_common.protos import generation_pb2 as pb
from engine_common.protos import generation_pb2_grpc


def build_request(args) -> pb.GenerateRequest:
    """A GenerateRequest from the `generate` subcommand's flags."""
    req = pb.GenerateRequest()
    if args.token_ids:
        req.token_ids.extend(int(t) for t in args.token_ids.split(","))
    elif args.prompt is not None:
        req.text = args.prompt
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(req.sampling, name, value)
    req.stopping.max_tokens = args.max_tokens
    req.stopping.min_tokens = args.min_tokens
    req.stopping.stop.extend(args.stop)
    req.stopping.ignore_eos = args.ignore_eos
    return req


def generate(args) -> int:
    """Run the stream; 0 on a finished request, 1 on a gRPC error."""
    with grpc.insecure_channel(args.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        last = None
        try:
            for resp in stub.Generate(build_request(args), timeout=args.timeout):
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
