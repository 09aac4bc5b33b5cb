"""How long one heavy request stalls the event loop that serves every other stream (brief 40c).

    python -m bench.loop_stall --attack prompt_logprobs --prompt-tokens 100000

A real in-process gRPC server (deltaserve.v1.Generation and vLLM's VllmEngine over an AsyncEngine)
on the tiny model (random weights, the 512-id test tokenizer, float32, CPU). A victim client
streams a short greedy request and records the time of each message; once it has a few tokens
a second client sends the heavy request (`--attack`), and the victim keeps reading until the
heavy one is answered. Reported: the victim's worst gap between messages before the heavy
request and while it runs, and the event loop's worst lateness meanwhile (a task that sleeps
1 ms and records how late it wakes: the loop's own stall, whatever the engine thread does).
The engine's step time grows with the heavy prefill too; the loop lateness isolates the loop.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")       # no GPU: Triton kernels interpreted

ATTACKS = ("prompt_logprobs", "top_logprobs", "stop_strings", "none")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.loop_stall",
                                description=__doc__.splitlines()[0])
    p.add_argument("--attack", choices=ATTACKS, default="prompt_logprobs")
    p.add_argument("--service", choices=("generation", "vllm"), default="generation")
    p.add_argument("--prompt-tokens", type=int, default=100_000, help="default: 100000")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="the heavy request's output tokens (default: 64)")
    p.add_argument("--k", type=int, default=20, help="top alternatives (default: 20)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="default: 8192")
    return p


def heavy_request(args, pb, vpb):
    """The attack as a request of `args.service`."""
    ids = [5 + i % 500 for i in range(args.prompt_tokens)]
    stops = [("x" * 40 + str(i)) for i in range(16)] if args.attack == "stop_strings" else []
    k = args.k
    if args.service == "generation":
        kw = {"prompt_logprobs": k} if args.attack == "prompt_logprobs" else {}
        if args.attack == "top_logprobs":
            kw["logprobs"] = k
        return pb.GenerateRequest(token_ids=ids, stopping=pb.StoppingCriteria(
            max_tokens=args.max_tokens, ignore_eos=True, stop=stops), **kw)
    sp = vpb.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, stop=stops)
    if args.attack == "prompt_logprobs":
        sp.prompt_logprobs = k
    if args.attack == "top_logprobs":
        sp.logprobs = k
    return vpb.GenerateRequest(request_id="heavy", tokenized=vpb.TokenizedInput(input_ids=ids),
                               sampling_params=sp, stream=True)


async def measure(args, llm) -> dict:
    import grpc

    from engine_common.wire.protos import generation_pb2 as pb
    from engine_common.wire.protos import (generation_pb2_grpc, vllm_engine_pb2,
                                           vllm_engine_pb2_grpc)
    from scheduler_service.api.front_door import ServedModel
    from scheduler_service.api.generation_servicer import GenerationServicer
    from scheduler_service.api.vllm_convert import EngineShape
    from scheduler_service.api.vllm_servicer import VllmEngineServicer
    from scheduler_service.engine.async_engine import AsyncEngine
    from scheduler_service.engine.kv_event_publisher import KvEventPublisher
    from scheduler_service.engine.output_processor import OutputProcessor

    engine = AsyncEngine(lambda: llm.engine.core, lambda: OutputProcessor(llm.tokenizer))
    engine.start()
    size = 1 << 30
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", size)])
    served = ServedModel(info=llm.model_info, tokenizer=llm.tokenizer, block_size=16)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, served),
                                                         server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(
        engine, served, EngineShape(16, 4, "float32", "auto"), KvEventPublisher(),
        lambda: engine.ready), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    lateness: list[float] = [0.0]
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lateness.append(time.perf_counter() - t - 0.001)
    try:
        assert await asyncio.to_thread(engine.wait_ready, 60), engine.last_error
        opts = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            victim = generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                token_ids=[3, 14, 15], stopping=pb.StoppingCriteria(max_tokens=llm.model_info.max_model_len - 8,
                                                                    ignore_eos=True)))
            stream = victim.__aiter__()
            times = []
            for _ in range(20):
                await stream.__anext__()
                times.append(time.perf_counter())
            before = max(b - a for a, b in zip(times[5:], times[6:]))
            tick = asyncio.ensure_future(ticker())
            if args.service == "generation":
                call = generation_pb2_grpc.GenerationStub(ch).Generate(
                    heavy_request(args, pb, vllm_engine_pb2))
            else:
                call = vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(
                    heavy_request(args, pb, vllm_engine_pb2))
            start = time.perf_counter()
            heavy = asyncio.ensure_future(_drain(call))
            during = [start]
            while not heavy.done():
                await stream.__anext__()
                during.append(time.perf_counter())
            heavy_s = time.perf_counter() - start
            messages = heavy.result()
            stop.set()
            await tick
            victim.cancel()
    finally:
        await server.stop(None)
        engine.shutdown()
    return {"victim_worst_gap_before_s": before,
            "victim_worst_gap_during_s": max(b - a for a, b in zip(during, during[1:])),
            "loop_worst_lateness_s": max(lateness), "heavy_s": heavy_s,
            "heavy_messages": messages}


async def _drain(call) -> int:
    n = 0
    async for _ in call:
        n += 1
    return n


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from deltaserve.llm import LLM
    from worker_service.models.tiny_model import make_tiny_model

    length = max(args.prompt_tokens + args.max_tokens, 2048) + 64
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, arch="llama", max_position_embeddings=length))
        llm = LLM(model, dtype="float32", max_model_len=length, block_size=16,
                  num_kv_blocks=length // 16 + 64, max_num_seqs=4,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        result = asyncio.run(measure(args, llm))
    print(f"attack={args.attack} service={args.service} prompt_tokens={args.prompt_tokens} "
          f"k={args.k}")
    for key, value in result.items():
        print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")


if __name__ == "__main__":
    main()
