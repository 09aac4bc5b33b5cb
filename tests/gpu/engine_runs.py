"""One in-process engine run on CUDA for the tests/gpu model checks: greedy tokens of the
bf16 scenario's prompts (tests/gpu/test_engine_bf16.py), the decode steps a graph replayed, and
the "decode CUDA graphs off" reason the runner logged at start-up (None when it captured)."""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine_common.request.params import SamplingParams, StoppingParams
from tests.gpu.test_engine_bf16 import MAX_NEW, _count_replays, _prompts
from tests.support.engine_checks import assert_no_leaked_blocks

RUNNER_LOG = "worker_service.runner.runner_kv_cache"     # logs "decode CUDA graphs off: ..."
GRAPHS_OFF = "decode CUDA graphs off: "


@dataclass(frozen=True)
class EngineRun:
    """What one engine run gave: prompts, greedy ids per prompt, graph replays, and the
    graph refusal the runner logged (None: it captured graphs)."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    replays: int
    graphs_off: str | None
    head_sizes: set[int]           # the caches' last dim
    shared_halves: list[bool]      # per layer: the [2, ...] cache one memory (stride 0)
    hybrid: bool                   # a window group beside the full one
    probed: object = None          # what run_engine's probe(runner) returned


class _Lines(logging.Handler):
    """Collects the formatted messages of one logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _start(path: str, handler: _Lines, **llm_args):
    """LLM(path, **llm_args) with the runner's start-up log collected by `handler`."""
    from deltaserve.llm import LLM

    logger = logging.getLogger(RUNNER_LOG)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return LLM(path, **llm_args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_engine(path: str, dtype: str, enforce_eager: bool, backend: str = "triton",
               block_size: int = 16, num_prompts: int | None = None,
               probe: Callable | None = None, device: str = "cuda", **engine) -> EngineRun:
    """The bf16 scenario (test_engine_bf16's prompts, MAX_NEW greedy tokens each, ignore_eos)
    on `path` on `device` (CUDA; the CPU checks this helper), all blocks back in the pool at the
    end. probe(runner), when given, is called after the run; its result is kept as `probed`."""
    handler = _Lines()
    llm = _start(path, handler, dtype=dtype, attention_backend=backend, block_size=block_size,
                 num_kv_blocks=4096 // block_size, enforce_eager=enforce_eager, device=device,
                 **engine)
    try:
        runner = llm.runner
        assert runner.attention_backend_name == backend
        assert {c.device.type for c in runner.kv_caches} == {torch.device(device).type}
        layout = ({c.shape[-1] for c in runner.kv_caches},
                  [c.stride(0) == 0 and c[0].data_ptr() == c[1].data_ptr()
                   for c in runner.kv_caches],
                  runner.window_group is not None)
        replays = _count_replays(llm.runner)
        prompts = _prompts(llm.model_info.vocab_size)[:num_prompts]
        outs = llm.generate(prompts, SamplingParams(),
                            StoppingParams(max_tokens=MAX_NEW, ignore_eos=True))
        assert_no_leaked_blocks(llm)
        off = [line[len(GRAPHS_OFF):] for line in handler.lines if line.startswith(GRAPHS_OFF)]
        assert (runner.graph_runner is None) == bool(off), (off, runner.graph_runner)
        return EngineRun(prompts, [o.token_ids for o in outs], replays[0],
                         off[0] if off else None, *layout,
                         probe(runner) if probe is not None else None)
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
