"""vLLM's --seed on `deltaserve serve`: the seeds the scheduler draws for requests without one
follow from it, so a request that sets none samples as the same request with the drawn seed
(and a run's unseeded requests repeat on every run in the same order)."""
from __future__ import annotations

import random

import grpc

from tests.support.grpc_harness import (Processes, collect, free_port, generation_stub, pb,
                                        wait_ready)

PROMPT = [3, 14, 15, 92, 65]


def _sampled(stub, request_id: str, seed: int | None) -> list[int]:
    sampling = pb.SamplingParams(temperature=1.0)
    if seed is not None:
        sampling.seed = seed
    request = pb.GenerateRequest(request_id=request_id, token_ids=PROMPT, sampling=sampling,
                                 stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True))
    return collect(stub.Generate(request, timeout=120))[0]


def test_serve_seed_makes_unseeded_requests_sample_with_the_seeds_it_draws(tiny_models,
                                                                           tmp_path):
    drawn = random.Random(7)                 # the scheduler's stream under --seed 7
    first, second = drawn.getrandbits(63), drawn.getrandbits(63)
    procs = Processes(tmp_path)
    try:
        port = free_port()
        serve = procs.serve(port, free_port(), "--model", tiny_models("qwen3"), "--seed", "7",
                            "--metrics-listen", "off")
        wait_ready(f"127.0.0.1:{port}", [serve], timeout=300)   # a busy 2-core machine
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_stub(channel)
            unseeded = [_sampled(stub, "u1", None), _sampled(stub, "u2", None)]
            seeded = [_sampled(stub, "s1", first), _sampled(stub, "s2", second)]
    finally:
        procs.close()
    assert unseeded == seeded, (unseeded, seeded)
    assert unseeded[0] != unseeded[1]        # two draws, not one seed for every request
