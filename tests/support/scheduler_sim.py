"""A plain-Python stand-in for the worker side, for driving the scheduler in tests.

`SimWorker` applies each diff exactly as engine_common/wire/diff.py says a worker must (after a codec
round trip), keeps its own copy of every request's tokens and block table, and "computes" a fake
paged KV cache: the slot of position p holds an id of the token prefix [0..p]. Every step it
checks that each scheduled request reads back the right prefix from its block table, so a wrong
block id, a prefix-cache hit on the wrong block or a block reused while still in use fails loudly.
With a sliding window W, as attention it reads only the positions a step's queries see (from its
first query's p - W + 1 on): the scheduler may have freed and reused the blocks below. With a
hybrid model's window group (`window_group`), a second fake cache stands for the windowed layers:
every position is written to both, the full one is read from position 0, the window one (through
the window tables of new_window_block_ids) from the first query's p - W + 1.
Sampled tokens come from `sample_fn(state)`, deterministic in the request's seed and tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_common.wire.codec import (decode_runner_output, decode_scheduler_output,
                                 encode_runner_output, encode_scheduler_output)
from engine_common.wire.diff import RunnerOutput, SchedulerOutput
import random
from engine_common.configuration.config import SchedulerConfig
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler


@dataclass
class SimRequest:
    handle: int
    tokens: list[int]
    num_prompt: int
    seed: int
    stop_ids: tuple[int, ...]
    num_logprobs: int
    block_ids: list[int]
    num_computed: int
    prefix_ids: list[int] = field(default_factory=list)   # prefix id per position
    window_ids: list[int] = field(default_factory=list)   # the window group's block table

    def prefix_id(self, pos: int) -> int:
        while len(self.prefix_ids) <= pos:
            prev = self.prefix_ids[-1] if self.prefix_ids else 0
            self.prefix_ids.append(hash((prev, self.tokens[len(self.prefix_ids)])))
        return self.prefix_ids[pos]

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.num_prompt:]


def default_sample(state: SimRequest) -> int:
    """A token id in [100, 600) that depends only on the seed and the sequence so far."""
    return hash((state.seed, tuple(state.tokens))) % 500 + 100


class SimWorker:
    def __init__(self, num_blocks: int, block_size: int, sample_fn=default_sample,
                 window: int = 0, window_group=None):
        self.block_size = block_size
        self.window = window
        self.kv = [None] * (num_blocks * block_size)
        self.group = window_group
        self.window_kv = [None] * (window_group.num_blocks * block_size if window_group else 0)
        self.sample_fn = sample_fn
        self.reqs: dict[int, SimRequest] = {}
        self.batch: list[int] = []
        self.next_step = 0
        self.diffs: list[SchedulerOutput] = []
        self.encoded_sizes: list[int] = []
        self.step_tokens: list[dict[int, int]] = []   # per step: handle -> tokens computed
        # Constrained requests "compile" for compile_steps steps (None: until release_compiles),
        # then are reported in RunnerOutput.compiled_handles; sampling one before is an error.
        self.compile_steps: int | None = 0
        self.compiling: dict[int, int] = {}

    def release_compiles(self) -> None:
        self.compile_steps = 0
        self.compiling = dict.fromkeys(self.compiling, 0)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        payload = encode_scheduler_output(out)
        decoded = decode_scheduler_output(payload)
        assert decoded == out, "SchedulerOutput codec round trip changed the diff"
        self.diffs.append(decoded)
        self.encoded_sizes.append(len(payload))
        self._apply(decoded)
        result = self._run(decoded)
        back = decode_runner_output(encode_runner_output(result))
        assert back == result, "RunnerOutput codec round trip changed the reply"
        return back

    def _apply(self, out: SchedulerOutput) -> None:
        assert out.step == self.next_step, f"step gap: got {out.step}, want {self.next_step}"
        self.next_step += 1
        for h in out.finished_handles:
            assert h in self.reqs, f"finished handle {h} was never sent"
            del self.reqs[h]
            self.compiling.pop(h, None)
            if h in self.batch:
                self.batch.remove(h)
        for h in out.preempted_handles:
            self.batch.remove(h)
        for new in out.new_requests:
            assert new.handle not in self.reqs, f"handle {new.handle} reused while live"
            self.reqs[new.handle] = SimRequest(
                new.handle, list(new.prompt_token_ids), len(new.prompt_token_ids),
                new.sampling.seed, new.sampling.stop_ids, new.num_logprobs, list(new.block_ids),
                new.num_computed_tokens)
            self.batch.append(new.handle)
            if new.constraint is not None:
                self.compiling[new.handle] = self.compile_steps
        for res in out.resumed_requests:
            assert res.handle in self.reqs and res.handle not in self.batch
            state = self.reqs[res.handle]
            state.block_ids = list(res.block_ids)
            state.num_computed = res.num_computed_tokens
            state.window_ids = []
            self.batch.append(res.handle)
        for h, ids in out.new_block_ids.items():
            assert h in self.batch
            self.reqs[h].block_ids.extend(ids)
        assert not out.new_window_block_ids or self.group is not None
        for h, ids in out.new_window_block_ids.items():
            assert h in self.batch
            self.reqs[h].window_ids.extend(ids)
        assert set(out.num_scheduled_tokens) <= set(self.batch)

    def _slot(self, state: SimRequest, pos: int) -> int:
        return state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _window_slot(self, state: SimRequest, pos: int) -> int:
        bs = self.block_size
        assert pos // bs < len(state.window_ids), "window-group table too short"
        return state.window_ids[pos // bs] * bs + pos % bs

    def _run(self, out: SchedulerOutput) -> RunnerOutput:
        work = [(self.reqs[h], out.num_scheduled_tokens.get(h, 1)) for h in self.batch]
        work = [(s, n) for s, n in work if n > 0]
        self.step_tokens.append({s.handle: n for s, n in work})
        # Like the attention backends: write the whole batch's KV first, then attend.
        for state, n in work:
            end = state.num_computed + n
            assert end <= len(state.tokens), f"handle {state.handle}: scheduled past its tokens"
            assert len(state.block_ids) * self.block_size >= end, "block table too short"
            for pos in range(state.num_computed, end):
                self.kv[self._slot(state, pos)] = state.prefix_id(pos)
                if self.group is not None:
                    self.window_kv[self._window_slot(state, pos)] = state.prefix_id(pos)
        result = RunnerOutput(out.step)
        for state, n in work:
            first = max(0, state.num_computed - self.window + 1) if self.window else 0
            state.num_computed += n
            for pos in range(first, state.num_computed):
                assert self.kv[self._slot(state, pos)] == state.prefix_id(pos), (
                    f"handle {state.handle}: wrong KV at position {pos}")
            if self.group is not None:
                start = max(0, state.num_computed - n - self.group.window + 1)
                for pos in range(start, state.num_computed):
                    assert self.window_kv[self._window_slot(state, pos)] == state.prefix_id(
                        pos), f"handle {state.handle}: wrong window-group KV at {pos}"
            if state.num_computed == len(state.tokens):
                assert state.handle not in self.compiling, (
                    f"handle {state.handle} samples before its grammar compiled")
                token = self.sample_fn(state)
                state.tokens.append(token)
                result.handles.append(state.handle)
                result.sampled_token_ids.append(token)
                result.logprobs.append(-0.5)
                if state.num_logprobs > 0:          # NO_LOGPROBS (-1): none
                    k = state.num_logprobs
                    result.top_logprobs[state.handle] = (list(range(k)), [-1.0] * k)
        # As the sampler: a step where no sampled row wants a logprob computes none.
        if all(self.reqs[h].num_logprobs < 0 for h in result.handles):
            result.logprobs = []
        for h, left in list(self.compiling.items()):
            if left is None:
                continue
            if left == 0:
                del self.compiling[h]
                result.compiled_handles.append(h)
            else:
                self.compiling[h] = left - 1
        return result


def _check_scheduled(scheduler, step: int, tokens: dict[int, int]) -> None:
    """The scheduler's account of a step agrees with what the worker computed."""
    assert scheduler.scheduled_tokens(step) == tokens
    assert scheduler.scheduled_size(step) == (len(tokens), sum(tokens.values()))


def run_steps(scheduler, worker: SimWorker, max_steps: int = 1000, on_step=None):
    """schedule -> worker -> update until no request is left. Returns all updates."""
    updates = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        runner_out = worker.execute(out)
        _check_scheduled(scheduler, out.step, worker.step_tokens[-1])
        step_updates = scheduler.update_from_output(out, runner_out)
        updates.extend(step_updates)
        if on_step is not None:
            on_step(out, step_updates)
    assert not scheduler.has_unfinished_requests(), "requests left after max_steps"
    return updates


def make_request(rid, prompt, max_tokens=8, seed=1, priority=0, arrival=None, **stopping):
    kw = {} if arrival is None else {"arrival_time": arrival}
    return Request(rid, list(prompt), SamplingParams(seed=seed),
                   StoppingParams(max_tokens=max_tokens, **stopping), eos_token_ids=(2,),
                   priority=priority, **kw)


def make(num_blocks=64, sample_fn=None, sliding_window=0, window_group=None, vocab_size=None,
         **cfg):
    config = SchedulerConfig(**{"block_size": 4, "max_num_seqs": 8,
                                "max_num_batched_tokens": 32, "max_model_len": 128, **cfg})
    sched = Scheduler(config, num_blocks, rng=random.Random(0), sliding_window=sliding_window,
                      window_group=window_group, vocab_size=vocab_size)
    kw = {} if sample_fn is None else {"sample_fn": sample_fn}
    return sched, SimWorker(num_blocks, config.block_size, window=sliding_window,
                            window_group=window_group, **kw)


def assert_no_leak(sched):
    assert sched.num_free_blocks == sched.num_total_blocks
    assert sched.kv_cache_usage == 0.0
    assert sched.num_running == 0 and sched.num_waiting == 0


def step(sched, worker):
    out = sched.schedule()
    runner_out = worker.execute(out)
    _check_scheduled(sched, out.step, worker.step_tokens[-1])
    return out, sched.update_from_output(out, runner_out)
