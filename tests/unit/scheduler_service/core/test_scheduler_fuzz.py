"""Seeded random interleavings of add / abort / step / reset_prefix_cache against the real
scheduler and SimWorker (which checks every block table against its fake paged KV), with the
KV invariants of tests/support/kv_invariants.py asserted after every call, and the KV events
replayed into a router's view that must equal the prefix cache. Steps run synchronously, or two
or three in flight (the worker running each as it is scheduled, or only when it is collected).

The pools are tiny (preemption is frequent), prompts share prefixes within and across cache
salts, ids are reused after their request finished or was aborted, and aborts hit requests
waiting, mid chunked prefill, running, preempted, just finished, and ids never seen. Every
request that ends without an abort must end with exactly the tokens a lone run gives
(`reference_output`), whatever it went through."""
from __future__ import annotations

import random
from collections import deque

import pytest

from scheduler_service.core.admission import RequestRejected
from scheduler_service.core.kv_events import AllBlocksCleared, BlockRemoved, KvEventFeed
from engine_common.request.kv_groups import WindowGroup
from scheduler_service.core.request import Request, RequestStatus
from engine_common.constraints.constraint import Constraint
from tests.support.kv_invariants import check_kv_invariants
from tests.support.scheduler_sim import default_sample, make, make_request

EOS = 2
SALTS = ("", "tenant-a", "tenant-b")
YES_NO = Constraint("choice", ("yes", "no"))


def sample(state) -> int:
    """default_sample, with the eos id about one token in 25."""
    token = default_sample(state)
    return EOS if token % 25 == 0 else token


class _State:
    def __init__(self, seed, tokens):
        self.seed, self.tokens = seed, tokens


def reference_output(request: Request) -> list[int]:
    """The request's tokens when it runs alone: `sample` until eos or its output cap."""
    tokens = list(request.prompt_token_ids)
    out = []
    # (a prompt that fills max_len still samples its one token, as vLLM's)
    while len(out) < max(1, request.max_num_output_tokens):
        token = sample(_State(request.sampling.seed, tokens))
        tokens.append(token)
        out.append(token)
        if token == EOS:
            break
    return out


class Fuzz:
    """One random run: the scheduler, its SimWorker, and what the test knows of each request."""

    def __init__(self, seed: int, mode: str, **cfg):
        """mode: "sync"; "async", two steps in flight, the worker running each as it is
        scheduled; "lagging", the same with the worker running a step only when its output is
        collected (a whole step behind the scheduler); "async3" and "lagging3", the same with
        three steps in flight (workers that pipeline their steps: engine_core.py)."""
        self.rng = random.Random(seed)
        self.mode = mode
        self.sched, self.worker = make(sample_fn=sample, async_scheduling=mode != "sync", **cfg)
        # A router's view of the prefix cache, kept from the KV events alone.
        self.events = KvEventFeed()
        self.events.enabled = True
        self.sched.kv.events = self.sched.kv.pool.events = self.events
        self.router_view: set[bytes] = set()
        # Steps whose priority preemption preempted someone: the head must be admitted in them.
        self.priority_steps: set[int] = set()
        preempt_for_priority = self.sched._preempt_for_priority

        def watched(plan):
            preempt_for_priority(plan)
            if plan.preempted_handles:
                self.priority_steps.add(self.sched._step)
        self.sched._preempt_for_priority = watched
        self.in_flight: deque = deque()
        self.gone: list[Request] = []
        self.next_id = 0
        bs = self.sched.config.block_size
        self.prefixes = {s: [self.rng.randrange(3, 90) for _ in range(3 * bs)] for s in SALTS}
        self.checked = 0
        self.worker.compile_steps = self.rng.randrange(4)

    # ---- operations --------------------------------------------------------------------

    def add(self) -> None:
        rng, sched = self.rng, self.sched
        salt = rng.choice(SALTS)
        prompt = self.prefixes[salt][:rng.randrange(0, 13)] if rng.random() < 0.7 else []
        prompt += [rng.randrange(3, 90) for _ in range(rng.randrange(1, 20))]
        max_tokens = None if rng.random() < 0.15 else rng.randrange(1, 12)
        if rng.random() < 0.05:      # at the edges: the whole cache, max_model_len - 1, ...
            cfg = sched.config
            size = rng.choice([sched.max_len, sched.max_len - 1, cfg.max_model_len - 1,
                               cfg.max_model_len])
            prompt = (prompt * size)[:size]
            max_tokens = rng.choice([None, 1, 2])
        if rng.random() < 0.1:       # the same tokens under another salt
            salt = rng.choice(SALTS)
        gone_ids = [r.request_id for r in self.gone if r.request_id not in sched._requests]
        if gone_ids and rng.random() < 0.3:
            rid = rng.choice(gone_ids)          # an id reused after its request left
        else:
            rid, self.next_id = f"r{self.next_id}", self.next_id + 1
        request = make_request(rid, prompt, max_tokens=max_tokens, seed=rng.randrange(1000),
                               priority=rng.randrange(3), arrival=float(self.next_id))
        request.cache_salt = salt
        if rng.random() < 0.1:       # waits for its grammar's compile before it samples
            request.constraint = YES_NO
        try:
            sched.add_request(request)
        except RequestRejected:
            assert rid not in sched._requests or sched._requests[rid] is not request
            bs = sched.config.block_size
            assert len(prompt) + (max_tokens or 1) > sched.config.max_model_len \
                or -(-len(prompt) // bs) > sched.max_prompt_blocks \
                or len(sched.waiting) >= sched.config.max_waiting
        if sched._requests and rng.random() < 0.1:   # a live id again: refused, nothing changes
            live = rng.choice(list(sched._requests.values()))
            twin = make_request(live.request_id, [5, 6, 7], max_tokens=2)
            with pytest.raises(RequestRejected):
                sched.add_request(twin)
            assert sched._requests[live.request_id] is live

    def abort(self) -> None:
        rng, sched = self.rng, self.sched
        pool = list(sched._requests) + [r.request_id for r in self.gone[-5:]] + ["never-seen"]
        rid = rng.choice(pool)
        live = sched._requests.get(rid)
        done = sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        assert done == ([live] if live is not None else [])
        if live is not None:
            self.gone.append(live)

    def step(self) -> None:
        sched = self.sched
        if sched.has_unfinished_requests() or sched.has_finished_to_send():
            out = sched.schedule()
            lagging = self.mode.startswith("lagging")
            self.in_flight.append((out, None if lagging else self.execute(out)))
        depth = {"sync": 1, "async3": 3, "lagging3": 3}.get(self.mode, 2)
        if len(self.in_flight) >= depth or (self.in_flight and not sched.has_unfinished_requests()):
            out, result = self.in_flight.popleft()
            if result is None:
                result = self.execute(out)
            for update in sched.update_from_output(out, result):
                if update.finished:
                    self.finished(update.request)

    def execute(self, out):
        """The worker runs the step; the scheduler's account of it must match, and a step that
        preempted for priority admitted someone (no preemption for nothing)."""
        if out.step in self.priority_steps:
            assert out.new_requests or out.resumed_requests, f"step {out.step}: for nothing"
        result = self.worker.execute(out)
        assert self.sched.scheduled_tokens(out.step) == self.worker.step_tokens[-1]
        return result

    def finished(self, request: Request) -> None:
        self.gone.append(request)
        if request.status == RequestStatus.FINISHED_ABORTED:
            return
        want = reference_output(request)
        assert request.output_token_ids == want, (
            f"{request.request_id} ({request.num_preemptions} preemptions): "
            f"{request.output_token_ids} != {want}")
        self.checked += 1

    def reset(self) -> None:
        kv = self.sched.kv
        idle = kv.num_free_blocks == kv.num_total_blocks
        assert kv.reset_prefix_cache() == idle
        if idle:
            assert kv.pool.num_cached_blocks == 0

    def check_events(self) -> None:
        """Replaying the KV events gives exactly the blocks the prefix cache holds."""
        for event in self.events.take():
            if isinstance(event, AllBlocksCleared):
                self.router_view.clear()
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.router_view
                self.router_view.difference_update(event.block_hashes)
            else:
                assert not set(event.block_hashes) & self.router_view, "stored twice"
                self.router_view.update(event.block_hashes)
        assert self.router_view == set(self.sched.kv.pool._cached)

    # ---- the run -------------------------------------------------------------------------

    def run(self, num_ops: int) -> None:
        ops = [(self.add, 0.3), (self.abort, 0.07), (self.reset, 0.03), (self.step, 0.6)]
        funcs, weights = zip(*ops)
        for _ in range(num_ops):
            self.rng.choices(funcs, weights)[0]()
            check_kv_invariants(self.sched, self.gone)
            self.check_events()
        for _ in range(20000):
            if not (self.sched.has_unfinished_requests() or self.in_flight
                    or self.sched.has_finished_to_send()):
                break
            self.step()
            check_kv_invariants(self.sched, self.gone)
            self.check_events()
        sched = self.sched
        assert not sched.has_unfinished_requests() and not self.in_flight
        assert sched.num_free_blocks == sched.num_total_blocks
        assert self.worker.reqs == {}, "the workers still hold finished requests"
        assert sched.kv.reset_prefix_cache() and sched.kv.pool.num_cached_blocks == 0
        # The prefix-cache counts are those of first admissions (new requests), hits included.
        new = [n for d in self.worker.diffs for n in d.new_requests]
        stats = sched.kv.stats
        if sched.config.enable_prefix_caching:
            assert stats.queries == sum(len(n.prompt_token_ids) for n in new)
            assert stats.hits == sum(n.num_computed_tokens for n in new)
        else:
            assert stats.queries == stats.hits == 0


CONFIGS = [
    dict(num_blocks=10, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=48),
    dict(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=12, max_model_len=64,
         long_prefill_token_threshold=6, max_long_partial_prefills=2),
    dict(num_blocks=8, max_num_seqs=1, max_num_batched_tokens=1, max_model_len=32),
    dict(num_blocks=24, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=96,
         enable_prefix_caching=False),
    # the largest batch limits, 8-token blocks; 1-token blocks with every prompt a long one
    dict(block_size=8, num_blocks=6, max_num_seqs=65536, max_num_batched_tokens=65536,
         max_model_len=48),
    dict(block_size=1, num_blocks=24, max_num_seqs=2, max_num_batched_tokens=3,
         max_model_len=24, long_prefill_token_threshold=1, max_long_partial_prefills=3),
    # a sliding window on every layer: requests outgrow the pool (blocks freed as they go)
    dict(sliding_window=8, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=8,
         max_model_len=64),
    dict(sliding_window=5, num_blocks=12, max_num_seqs=3, max_num_batched_tokens=8,
         max_model_len=80, long_prefill_token_threshold=4, max_long_partial_prefills=2),
    # the edges: a window of 1 (each query sees only its own key: a hit needs no block) and a
    # window smaller than a block (the block of the first query is the only one kept)
    dict(sliding_window=1, num_blocks=8, max_num_seqs=4, max_num_batched_tokens=8,
         max_model_len=64),
    dict(sliding_window=3, block_size=8, num_blocks=8, max_num_seqs=4,
         max_num_batched_tokens=16, max_model_len=64),
    # a hybrid model's two groups (hybrid_kv.py): the window pool at its bound
    # (kv_groups.window_pool_bound), and one below it, whose shortage must preempt or wait
    dict(window_group=WindowGroup(8, 4 * (2 + 3) + 2 * 2), num_blocks=16, max_num_seqs=4,
         max_num_batched_tokens=8, max_model_len=64),
    dict(window_group=WindowGroup(5, 8), num_blocks=20, max_num_seqs=3,
         max_num_batched_tokens=8, max_model_len=64),
]


@pytest.mark.parametrize("mode", ["sync", "async", "lagging", "async3", "lagging3"])
@pytest.mark.parametrize("cfg", range(len(CONFIGS)))
@pytest.mark.parametrize("seed", range(3))
def test_random_interleavings_keep_the_kv_invariants(seed, cfg, mode):
    fuzz = Fuzz(seed * 101 + cfg, mode, **CONFIGS[cfg])
    fuzz.run(400)
    assert fuzz.checked > 5, "too few requests ran to the end to compare their tokens"
