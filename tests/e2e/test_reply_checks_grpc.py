"""The step-reply checks over gRPC, as `deltaserve serve` wires them (server.py: the model's
config vocab_size, WorkerCoreFactory): a real worker process on a tiny model whose config
vocab_size is padded past its tokenizer (as Qwen's), two steps in flight. Ids of the padding
rows are ones the model may sample (transformers would): every reply is accepted, no stream
ends UNAVAILABLE, and the tokens are those of the in-process engine."""
from __future__ import annotations

import asyncio
import dataclasses

from deltaserve.llm import LLM
from engine_common.configuration.config import SchedulerConfig
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.api.worker_core_factory import WorkerCoreFactory
from scheduler_service.core.request import Request
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.workers.worker_client import WorkerClient
from tests.support.engine_streams import run_started
from tests.support.grpc_harness import Processes, free_port
from tests.support.init_specs import init_spec
from tests.support.tp_harness import engine_on, reference, run_requests, scheduler_config

PAD = 64


def test_padded_vocabulary_ids_pass_the_checks_with_steps_in_flight(tiny_models, tmp_path):
    size = Tokenizer.from_dir(tiny_models("qwen3")).vocab_size
    model = tiny_models("qwen3", vocab_size=size + PAD)
    info = ModelInfo.from_dir(model)
    last = info.vocab_size - 1
    assert last >= size                          # a padding row, no token of the tokenizer
    samplings = [SamplingParams(allowed_token_ids=(last,)),
                 SamplingParams(temperature=0.9, seed=4, allowed_token_ids=(last, 9)),
                 SamplingParams(logit_bias=((last - 1, 100.0),))]
    stop = StoppingParams(max_tokens=10, ignore_eos=True)
    prompts = [[3, 14, 15, 92, 65], [2, 71, 82, 81], [7, 7, 8]]
    want = [c.token_ids for c in LLM(model, dtype="float32", num_kv_blocks=64).generate(
        prompts, samplings, stop, num_logprobs=4, num_prompt_logprobs=3)]
    assert want[0] == [last] * 10 and want[2] == [last - 1] * 10

    procs = Processes(tmp_path)
    port = free_port()
    procs.worker(port)
    client = WorkerClient([f"127.0.0.1:{port}"], connect_timeout_s=60.0, step_timeout_s=60.0)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                             block_size=16, async_scheduling=True)
    spec = init_spec(model, max_model_len=256, block_size=16, max_num_seqs=4,
                     max_num_batched_tokens=32, kv_cache_bytes=1 << 20)
    engine = AsyncEngine(WorkerCoreFactory(client, spec, config, vocab_size=info.vocab_size),
                         lambda: OutputProcessor(Tokenizer.from_dir(model)))

    async def run(i: int) -> list[int]:
        request = Request(f"r{i}", prompts[i], samplings[i], stop, info.eos_token_ids,
                          num_logprobs=4, num_prompt_logprobs=3)
        ids = []
        async for out in engine.generate(request):      # EngineUnavailable: a refused reply
            ids += out.new_token_ids
        return ids

    async def scenario():
        assert await asyncio.to_thread(engine.wait_ready, 120), engine.last_error
        got = await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(3))), 120)
        assert got == want
        assert not engine.last_error, engine.last_error

    run_started(engine, scenario, 300, client, procs)


def test_tp2_padded_vocabulary_rows_past_each_ranks_shard(tp2_two_nodes, tiny_models):
    """TP=2 (two nodes, symmetry verified) on an odd padded vocabulary: each rank's shard is
    padded again to an equal width and trimmed after the gather. The output rank's replies carry
    the last padding id of the config and are accepted, the TP=1 tokens."""
    size = Tokenizer.from_dir(tiny_models("qwen3")).vocab_size
    vocab = size + PAD + 1 - (size + PAD) % 2            # odd: rank 1's shard has a pad row
    model = tiny_models("qwen3", vocab_size=vocab)
    prompts = [[3, 14, 15, 92, 65], [2, 71, 82, 81], [7, 7, 8]]
    samplings = [SamplingParams(allowed_token_ids=(vocab - 1,)),
                 SamplingParams(temperature=0.9, seed=4, allowed_token_ids=(vocab - 1, 9)),
                 SamplingParams(seed=5)]
    stoppings = [StoppingParams(max_tokens=8, ignore_eos=True)] * 3
    want, _ = reference(model, prompts, samplings, stoppings)
    assert want[0] == [vocab - 1] * 8
    config = dataclasses.replace(scheduler_config(), async_scheduling=True)
    with engine_on(tp2_two_nodes, model, config) as core:
        assert core.scheduler.vocab_size == vocab
        assert run_requests(core, model, prompts, samplings, stoppings) == want
