"""The continuous-batching scheduler: admission, per-step token budgets, preemption, stops.

NOTE the rules of one step (`schedule()`):
  * First, priority: when the most urgent waiting request does not fit (no seat under
    max_num_seqs, or too few free blocks for its first chunk), running requests of strictly lower
    priority are preempted to make room, least urgent first (scheduler_service/core/priority.py);
    the "most urgent" is the first that admission will try: long ones the long-prefill limit
    below holds back are passed by (a victim would only be readmitted past them).
  * Running requests next, most urgent first (the batch is kept in (priority, arrival) order);
    each asks for all its uncomputed tokens (1 when decoding), capped by what is left of
    max_num_batched_tokens. A request that gets no budget stays in the batch, idle (count 0).
  * A running request that cannot get a block preempts (by recompute) the lowest-priority,
    latest-arriving request among itself and those not yet scheduled this step (so never a more
    urgent one): its blocks are freed, its progress is reset, and it waits again, ahead of
    requests of its priority that never ran.
  * Only in a step without such memory preemption are waiting requests admitted, in queue order,
    while budget, max_num_seqs and blocks allow; a prompt longer than the budget left is chunked.
  * Long prefills (docs/scheduler.md, "Long prompts"): a running request with more than
    long_prefill_token_threshold (T) tokens left to compute is scheduled after the rest of the
    running batch, with what they leave, and at most T tokens while requests are waiting (so a
    new request's first step is admitted and stays short). At most max_long_partial_prefills of
    them are in progress at once: a further long request waits, and requests behind it in the
    queue that are short (or more urgent) are admitted past it.
  * An encoder model's pooling request (WHOLE_PROMPT: bidirectional attention) is admitted
    only with its whole prompt in the step, never chunked nor treated as long; while it does
    not fit, admission stops there (FCFS). A pooling request samples nothing: its vector,
    when it comes back, finishes it (sampled_tokens.finish_pooled).
  * A constrained request samples only once the output rank has reported its grammar compiled
    (RunnerOutput.compiled_handles, docs/structured-output.md): until then its prompt is
    prefilled up to its last token, which waits (an idle count 0 when nothing else is left).
  * The scheduler assumes every step it emits will run: num_computed_tokens advances at once.
  * Async scheduling (two steps in flight, or three: engine_core.py): a request that samples
    in a step still in flight counts that token as pending (two with three in flight); the next
    step may compute it (the workers know its id). A request whose pending tokens reach
    max_tokens or max_len is not scheduled (a preempted one not resumed) again. One preempted
    with tokens in flight keeps them (its workers hold them too) and recomputes them on resume.
  * Speculative decoding (speculative_config): after the running batch, one-token decodes get
    n-gram drafts (spec_decode.py), counted as pending; rejected ones are rolled back. With
    async scheduling, drafts over a step in flight assume its drafts accepted and guess its
    last token (the workers drop them where that fails).
  * Every returned diff must reach the workers (steps are numbered without gaps).
"""
from __future__ import annotations

import bisect
import random
import time
from collections.abc import Iterable

from engine_common.configuration.config import SchedulerConfig
from engine_common.request.kv_groups import WindowGroup
from engine_common.request.params import ParamError
from engine_common.request.pooling import is_whole_prompt
from engine_common.wire.diff import RunnerOutput, SchedulerOutput
from scheduler_service.core.admission import (QueueFull, RequestRejected, check_admission,
                                              prepare_queued)
from scheduler_service.core.handles import HandleAllocator
from scheduler_service.core.hybrid_kv import make_kv_manager
from scheduler_service.core.kv_events import KvEventFeed
from scheduler_service.core.long_prefills import can_admit_any, held_back
from scheduler_service.core.priority import priority_victims
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.reply_checks import check_reply
from scheduler_service.core.sampled_tokens import apply_sampled_tokens, grammars_compiled
from scheduler_service.core.scheduler_diff import StepPlan, build_output
from scheduler_service.core.scheduler_views import SchedulerViews
from scheduler_service.core.sliding_window import max_request_len
from scheduler_service.core.spec_decode import SpecDecoder
from scheduler_service.core.step_growth import advance
from scheduler_service.core.step_result import TokenUpdate
from scheduler_service.core.waiting_queue import WaitingQueue

__all__ = ["Scheduler", "RequestRejected", "QueueFull", "TokenUpdate"]

_RUNNING = RequestStatus.RUNNING


class Scheduler(SchedulerViews):
    """Owns the requests, the KV-cache blocks and the step diffs. Not thread-safe."""

    def __init__(self, config: SchedulerConfig, num_blocks: int,
                 rng: random.Random | None = None, kv_events: KvEventFeed | None = None,
                 sliding_window: int = 0, window_group: WindowGroup | None = None,
                 vocab_size: int | None = None):
        """`kv_events`, when given, records what the prefix cache stores and evicts.
        `sliding_window`: every attention layer's, as the workers report it (sliding_window.py).
        `window_group`: a hybrid model's windowed layers' pool (hybrid_kv.py); `num_blocks` is
        then the full group's. `vocab_size`: the model's, bounding a reply's ids (None: not
        checked)."""
        self.config = config
        self.vocab_size = vocab_size
        self.kv = make_kv_manager(config, num_blocks, kv_events, sliding_window, window_group)
        self._hybrid = window_group is not None
        if config.max_model_len is None:
            raise ParamError("max_model_len", None, "set: the scheduler needs the model's limit")
        # A request (its prompt too) fits the whole cache, unless a window lets it outgrow it.
        self.max_len = max_request_len(config, num_blocks, sliding_window)
        self.max_prompt_blocks = max(num_blocks, -(-self.max_len // config.block_size))
        self._long_prefill = config.long_prefill_threshold
        seeded = config.seed is not None     # --seed: unseeded requests' seeds repeat
        self._rng = rng or (random.Random(config.seed) if seeded else random.SystemRandom())
        self._handles = HandleAllocator()
        self._requests: dict[str, Request] = {}       # unfinished, by id
        self.waiting = WaitingQueue()
        self.running: list[Request] = []              # by (priority, arrival_time)
        self._on_worker: set[int] = set()             # handles the workers hold a copy of
        # handle -> (request, step it was sent in) for those awaiting their grammar's compile
        self._compiling: dict[int, tuple[Request, int]] = {}
        self._finished_handles: list[int] = []        # for the next diff, then recycled
        self._step = 0
        # step -> (handle -> request, handle -> tokens when not 1) for the requests that compute
        self._in_flight: dict[int, tuple[dict[int, Request], dict[int, int]]] = {}
        spec = config.speculative        # n-gram drafts (spec_decode.py); None: off
        self.spec = None if spec is None else SpecDecoder(spec)
        self.lora_cache = None           # --max-cpu-loras: the adapters loaded (lora_cache.py)

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises RequestRejected (or its subclass QueueFull)."""
        check_admission(request, max_model_len=self.config.max_model_len,
                        max_step_tokens=self.config.max_num_batched_tokens,
                        block_size=self.config.block_size, num_blocks=self.max_prompt_blocks,
                        num_waiting=len(self.waiting), max_waiting=self.config.max_waiting,
                        known=request.request_id in self._requests)
        seed = request.sampling.seed
        # One concrete seed so every tensor-parallel rank samples the same stream.
        prepare_queued(request, self._handles.allocate(),
                       self._rng.getrandbits(63) if seed is None else seed, self.max_len)
        self._requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus) -> list[Request]:
        """Finish (abort, stop-string hit, ...) unfinished requests wherever they are; frees
        their blocks. Unknown or already finished ids are ignored. Returns those finished."""
        if not status.finished:
            raise ValueError(f"status={status!r} is invalid: must be a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done = []
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is not None:
                self._finish(request, status)
                done.append(request)
        return done

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self._remove_running(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.finish_time = time.monotonic()
        request.num_pending_tokens = 0    # an in-flight step's token for it is dropped
        self.kv.free(request)
        del self._requests[request.request_id]
        if request.awaiting_grammar:
            self._compiling.pop(request.handle, None)
        if request.handle in self._on_worker:
            self._on_worker.remove(request.handle)
            self._finished_handles.append(request.handle)
        else:
            self._handles.release(request.handle)

    def _remove_running(self, request: Request) -> None:
        for i, r in enumerate(self.running):
            if r is request:
                del self.running[i]
                return

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the NOTE at the top) and return its diff."""
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        self._preempt_for_priority(plan)
        num_for_priority = len(plan.preempted_handles)
        long_priorities = self._schedule_running(plan)
        if self.spec is not None and plan.work:
            self.spec.add_drafts(self._step, plan, self.kv)
        if len(plan.preempted_handles) == num_for_priority:
            self._schedule_waiting(plan, long_priorities)
        out = build_output(self._step, plan, self._finished_handles)
        if self._hybrid and self.kv.window_ids:
            out.new_window_block_ids = self.kv.take_window_ids()
        for handle in self._finished_handles:
            self._handles.release(handle)
        self._finished_handles = []
        if plan.work:
            self._in_flight[self._step] = (plan.work, dict(plan.counts))
        self._step += 1
        return out

    def _preempt_for_priority(self, plan: StepPlan) -> None:
        """Make room for the first waiting request admission will try (priority.py)."""
        if not self.waiting or not self.running:
            return
        for victim in priority_victims(self.waiting, self.running, self.kv,
                                       self.config.max_num_seqs, self._long_prefill,
                                       plan.budget, self._held_back):
            self._preempt(victim, plan)

    def _schedule_running(self, plan: StepPlan) -> list[int]:
        """Schedule the running batch; returns the priorities of its long prefills."""
        # The hot loop (every running request, every step): no helper calls, and the KV manager
        # only when its quiet_until says allocate_slots would do something. A request asks for
        # its known and pending tokens not computed yet, or none when a pending token will
        # already be its last (max_tokens, max_len); then it advances as step_growth.advance
        # says. Long prefills wait for the rest (_schedule_long_prefills).
        running, grow, quiet_until = self.running, self.kv.grow_slots, self.kv.quiet_until
        work, counts, new_block_ids = plan.work, plan.counts, plan.new_block_ids
        budget, threshold = plan.budget, self._long_prefill
        longs = []
        preempted, gated = False, bool(self._compiling)
        for request in list(running):      # a copy: preemption takes requests out of running
            if preempted and request.status is not _RUNNING:
                continue                   # preempted earlier in this loop
            num_output, pending = len(request.output_token_ids), request.num_pending_tokens
            wanted = len(request.prompt_token_ids) + num_output + pending
            computed = request.num_computed_tokens
            if pending and num_output + pending >= request.max_num_output_tokens:
                n = 0
            else:
                n = wanted - computed
                if n > threshold:
                    longs.append(request)
                    continue
                if n > budget:
                    n = budget
                if gated and request.awaiting_grammar and computed + n >= wanted:
                    n = wanted - computed - 1      # its sampling waits for the compile
            if n <= 0:
                counts[request.handle] = 0     # stays in the batch, idle
                continue
            computed += n
            if computed > quiet_until[request.request_id]:
                new_ids = grow(request, n)
                if new_ids is None:
                    preempted = True
                    new_ids = self._allocate_or_preempt(request, n, plan)
                    if new_ids is None:
                        continue               # the request itself was preempted
                if new_ids:
                    new_block_ids[request.handle] = new_ids
            handle = request.handle
            work[handle] = request
            budget -= n
            if n != 1:
                counts[handle] = n
            request.num_computed_tokens = computed
            if computed >= wanted:
                request.num_pending_tokens += 1
        plan.budget = budget
        if longs:
            self._schedule_long_prefills(longs, plan)
        return [r.priority for r in longs]

    def _schedule_long_prefills(self, longs: list[Request], plan: StepPlan) -> None:
        """The long prefills of the running batch, in batch order: each takes what is left of
        the budget, at most T while requests wait, and no more than the free blocks hold (it
        does not preempt requests scheduled before it; alone in the step it may, as any)."""
        priorities = [r.priority for r in longs]
        admit = can_admit_any(self.waiting, self.kv, len(self.running), self.config, priorities)
        cap = self._long_prefill if admit else plan.budget
        for request in longs:
            if request.status is not _RUNNING:
                continue                   # preempted by a request after it
            wanted = request.num_tokens + request.num_pending_tokens
            left = wanted - request.num_computed_tokens - request.awaiting_grammar
            n = min(left, cap, plan.budget, self.kv.num_fitting_tokens(request))
            if n > 0:                    # fits by num_fitting_tokens: grow_fitting's contract
                new_ids = self.kv.grow_fitting(request, n)
            elif plan.work or plan.budget <= 0 or left <= 0:
                plan.counts[request.handle] = 0       # idle: the others free blocks in time
                continue
            else:
                n = min(left, cap)       # never its sampling position before the compile
                if (new_ids := self._allocate_or_preempt(request, n, plan)) is None:
                    continue
            if new_ids:
                plan.new_block_ids[request.handle] = new_ids
            plan.schedule(request, n)
            advance(request, n, wanted)

    def _allocate_or_preempt(self, request: Request, n: int, plan: StepPlan):
        """The ids of the blocks appended for `n` more tokens of a running request (grow_slots),
        preempting it or others after it in the batch (never one already scheduled this step)
        until they fit. None when `request` itself was preempted."""
        i = next(i for i, r in enumerate(self.running) if r is request)
        while (new_ids := self.kv.grow_slots(request, n)) is None:
            j = max(range(i, len(self.running)),
                    key=lambda k: (self.running[k].priority, self.running[k].arrival_time, k))
            victim = self.running[j]
            self._preempt(victim, plan)
            if victim is request:
                return None
        return new_ids

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        plan.counts.pop(request.handle, None)     # an idle one of this step's batch
        self._remove_running(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.push(request)
        plan.preempted_handles.append(request.handle)

    def _schedule_waiting(self, plan: StepPlan, long_priorities: list[int]) -> None:
        """Admit in queue order. A long request waits while max_long_partial_prefills long
        prefills at least as urgent are in progress, and those behind it may pass it; otherwise
        nobody overtakes a request that does not fit (FCFS). At most max_loras LoRA adapters
        run at once: a request of another adapter waits, and no adapter request behind it
        passes it (the running adapters drain, so it is not starved); base requests may. So
        does a request whose adapter is not loaded now (--max-cpu-loras), until it is."""
        waiting = self.waiting
        loras = ({r.lora_id for r in self.running if r.lora_id} if self.config.enable_lora
                 else None)
        lora_blocked = False
        i = 0
        while i < len(waiting) and plan.budget > 0 \
                and len(self.running) < self.config.max_num_seqs:
            request = waiting.at(i)
            if request.num_pending_tokens and request.ends_in_flight:
                i += 1                   # preempted, done once its tokens in flight arrive
                continue
            hits, num_hit = self.kv.get_computed_blocks(request)
            left = request.num_tokens - num_hit
            whole = is_whole_prompt(request.pooling)     # an encoder's: all of it, or wait
            is_long = left > self._long_prefill and not whole
            if is_long and self._held_back(request, long_priorities):
                i += 1
                continue
            if loras is not None and request.lora_id:
                if lora_blocked or not self._lora_loaded(request.lora_id) or (
                        request.lora_id not in loras and len(loras) >= self.config.max_loras):
                    lora_blocked = True
                    i += 1
                    continue
                loras.add(request.lora_id)
            n = min(left - request.awaiting_grammar, plan.budget)   # may be 0: sent, idle
            if whole and n < left:
                return                   # a later step has room for its whole prompt (FCFS)
            if is_long and (self.running or len(waiting) > 1):
                n = min(n, self._long_prefill)
            if self.kv.allocate_slots(request, n, hits) is None:
                return
            waiting.pop_at(i)
            if is_long:
                long_priorities.append(request.priority)
            self._admit(request, num_hit, n, plan)

    def _held_back(self, request: Request, long_priorities: list[int]) -> bool:
        return held_back(request, long_priorities, self.config.max_long_partial_prefills)

    def _admit(self, request: Request, num_hit: int, n: int, plan: StepPlan) -> None:
        resumed = request.status == RequestStatus.PREEMPTED
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        bisect.insort(self.running, request, key=lambda r: (r.priority, r.arrival_time))
        block_ids = self.kv.get_block_ids(request)
        if resumed:
            plan.add_resumed(request, block_ids, num_hit)
        else:
            plan.add_new(request, block_ids, num_hit)
            self._on_worker.add(request.handle)
            if request.awaiting_grammar:
                self._compiling[request.handle] = (request, self._step)
        plan.schedule(request, n)
        advance(request, n, request.num_tokens + request.num_pending_tokens)

    # ---- the step's results (applied in sampled_tokens.py) -------------------------------

    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: RunnerOutput) -> list[TokenUpdate]:
        """Check the reply (reply_checks.py: BadReply), abort what failed on the worker, append
        each sampled token, apply the stop rules, finish what stopped. Outputs for requests
        finished since the step was scheduled are dropped; one preempted since (async
        scheduling) keeps its token: the workers hold it."""
        scheduled, counts = self._in_flight.pop(sched_out.step, ({}, None))
        check_reply(sched_out.step, scheduled, counts, runner_out, self.vocab_size,
                    self.spec is not None)
        if runner_out.compiled_handles:
            grammars_compiled(self._compiling, sched_out.step, runner_out.compiled_handles)
        if self.spec is not None:
            return self.spec.apply(sched_out.step, scheduled, runner_out, self._finish,
                                   self.max_len)
        return apply_sampled_tokens(scheduled, runner_out, self._finish, self.max_len)
