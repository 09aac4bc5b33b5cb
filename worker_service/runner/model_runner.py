"""The model runner: applies each step's diff to its cached requests, runs the model, samples.

Every rank runs the same runner on the same diffs and samples the same tokens (seeded noise keyed
by request and position), so sampled ids never travel between ranks: each rank feeds them back
into its own persistent batch.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine_common.wire.codec import decode_scheduler_output
from engine_common.wire.diff import RunnerOutput, SchedulerOutput
from engine_common.request.diff_limits import max_diff_bytes
from engine_common.model_files.model_dir import ModelInfo
from kernels.attention.selector import CacheLayout, get_attention_backend, resolve_backend_name
from worker_service.batch.cached_requests import CachedRequests, rejoins
from worker_service.config import RunnerConfig
from worker_service.step.cuda_graphs import DecodeGraphRunner
from worker_service.batch.diff_check import BadDiff, DiffBounds, check_diff
from worker_service.batch.input_batch import InputBatch
from worker_service.runner.kv_dtype import fp8_problem
from worker_service.runner.memory_fit import kv_cache_dims, kv_value_dim, lora_bytes
from worker_service.runner.runner_kv_cache import RunnerKVCache
from worker_service.lora.load import check_lora_ids, load_lora
from worker_service.models.loader import kv_cache_halves, load_model, resolve_dtype
from worker_service.models.registry import MODEL_REGISTRY
from worker_service.parallel_state import TPGroup, single_rank_group
from worker_service.sample.grammar import GrammarBook, GrammarCompiler
from worker_service.sample.pooling import PoolingBook
from worker_service.sample.prompt_logprobs import PromptLogprobBook
from worker_service.sample.sampler import Sampler, with_grammar_masks
from worker_service.sample.spec_verify import prepare_with_drafts
from worker_service.sample.sampling_metadata import (build_sampling_metadata,
                                                     history_needed, staged_row_dtypes)
from worker_service.step.step_buffers import StepBuffers, attention_metadata, stage_step_inputs
from worker_service.failures import StepProtocolError
from worker_service.step.step_clock import StepClock
from worker_service.runner.simulated_device import SimulatedDevice
from worker_service.step.step_inputs import StepInputs
from worker_service.sample.token_readback import (PendingStep, SampledTokens, TokenFeed,
                                                  TokenReadback, top_alternatives)

# How long a step that computes nothing waits for a grammar compile to end (finish_step).
_IDLE_COMPILE_WAIT_S = 0.05


def cache_layout(hf_config: dict, config: RunnerConfig, tp_size: int = 1) -> CacheLayout:
    """What one rank (of tp_size) gives its attention backend (kernels/attention/selector.py)."""
    kv_heads, head_dim = kv_cache_dims(hf_config)   # DeepSeek: one latent head (layers/mla.py)
    arch = (hf_config.get("architectures") or [None])[0]
    sinks = bool(getattr(MODEL_REGISTRY.get(arch), "attention_sinks", False))
    heads = max(1, int(hf_config["num_attention_heads"]) // tp_size)
    group = heads // max(1, kv_heads // tp_size)
    return CacheLayout(config.block_size, head_dim,
                       resolve_dtype(hf_config, config.dtype, config.model_dir), sinks, group,
                       kv_value_dim(hf_config), kv_fp8=config.kv_cache_dtype != "auto")


class ModelRunner(RunnerKVCache):
    def __init__(self, config: RunnerConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or single_rank_group()
        self.device = torch.device(config.device)
        info = ModelInfo.from_dir(config.model_dir, config.max_model_len)
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        layout = cache_layout(info.hf_config, config, self.tp.world_size)
        self.attention_backend_name = resolve_backend_name(config.attention_backend,
                                                           self.device.type, layout)
        backend = get_attention_backend(self.attention_backend_name, self.device.type, layout)
        self._check_kv_cache_dtype(layout, loaded=False)     # before a weight is read
        self.model = load_model(config.model_dir, self.tp, backend, self.device, config.dtype,
                                fused_ops=config.fused_ops,
                                cpu_quantized_weights=config.cpu_quantized_weights)
        self._check_kv_cache_dtype(layout, loaded=True)      # the windows: the built model's
        # LoRA (docs/lora.md): None without --enable-lora (the model untouched), else LoRASlots.
        self.lora = load_lora(self.model, config)
        # the most its stacks may take (lora_memory.py): a profiled KV cache leaves it free
        self.lora_bound_bytes = lora_bytes(config, info, self.tp.world_size)
        self.sampler = Sampler()
        # Structured output: matchers of constrained requests, masks computed on every rank.
        self.grammar = GrammarBook(GrammarCompiler.for_model(config.model_dir, self.vocab_size,
                                                             info.eos_token_ids))
        self.prompt_logprobs = PromptLogprobBook(self.vocab_size)  # requests that asked
        # embedding and classification requests (docs/embeddings.md, docs/scoring.md); an
        # encoder or a classifier model serves nothing else
        self.pooling = PoolingBook.for_model(self.model, self.num_cache_layers)
        self.block_size = config.block_size
        max_blocks = -(-self.max_model_len // self.block_size)
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, max_blocks)
        # Persistent staging of every per-step input, and the pinned read-back buffers: two
        # sets, used by alternate steps, so a step can be launched while the one before it is
        # still on the device (launch_step before finish_step; see `pipelined`).
        self._stagings = [StepBuffers(config.max_num_batched_tokens, config.max_num_seqs,
                                      max_blocks, self.device, staged_row_dtypes(),
                                      window_group=bool(self.kv_layers[0]))
                          for _ in range(2)]
        # A speculative step draws at every draft position too: up to the token budget.
        self._readbacks = [TokenReadback(max(config.max_num_seqs, config.max_num_batched_tokens),
                                         self.device) for _ in range(2)]
        self.staging, self.readback = self._stagings[0], self._readbacks[0]
        # A stand-in for the forward pass and sampler (bench/host_overhead.py): the host work
        # is real, the device is a timed wait. None: the model runs.
        self.simulated = (SimulatedDevice(config.simulated_device_ms / 1e3, self.vocab_size)
                          if config.simulated_device_ms is not None else None)
        # Whether an async-scheduling executor should launch step t+1 before finishing step t
        # (RunnerPipeline): where launches are asynchronous, so the device runs ahead. Tests
        # turn it on for CPU runners, where it changes the order of work but not the tokens.
        self.pipelined = self.device.type == "cuda" or self.simulated is not None
        self.cached = CachedRequests(self.batch)
        self.requests = self.cached.states     # every cached request by handle
        self.kv_caches: list[torch.Tensor] = []
        self.window_group = None        # a hybrid model's window group (init_kv_cache)
        self.graph_runner: DecodeGraphRunner | None = None
        self.last_step = -1
        # Whether the last launched step verified drafts: its accepted run sets its rows'
        # lengths only when it finishes, so the next step waits for that (needs_host_tokens).
        self._launched_drafts = False
        self.clock = StepClock()          # the last step's phases, for the worker's metrics
        # Called once per step as the sampler (and the LM head, for hidden rows) starts: the
        # step's longest stretch without Python, which an in-process engine thread uses.
        self.on_sampling: Callable[[], None] | None = None
        self.max_payload_bytes = max_diff_bytes(config.max_num_seqs,
                                                config.max_num_batched_tokens,
                                                self.max_model_len, self.block_size)
        self.diff_bounds: DiffBounds | None = None    # set with the KV cache

    def _check_kv_cache_dtype(self, layout: CacheLayout, loaded: bool) -> None:
        """ValueError when --kv-cache-dtype names an fp8 cache this model cannot run with
        (worker_service/runner/kv_dtype.py: what is built). Before the weights load (`loaded`
        False) what config.json tells (backend, MLA's value, sinks); after, the layer
        windows too, which the built model holds."""
        latent = bool(layout.value_dim) or (loaded and kv_cache_halves(self.model) == 1)
        windows = self.layer_windows + (self.sliding_window,) if loaded else ()
        why = fp8_problem(self.config.kv_cache_dtype, latent=latent,
                          sinks=layout.sinks, windows=windows,
                          backend=self.attention_backend_name)
        if why is not None:
            raise ValueError(why)

    def state_digest(self, out: RunnerOutput) -> bytes:
        """The digest of this step's sampled ids, the cached state and the grammars' (see
        CachedRequests.digest): equal on every rank while the ranks agree (verify_symmetry)."""
        return self.cached.digest(out.handles, out.sampled_token_ids, self.grammar.digest())

    def reset(self) -> None:
        """Drop every cached request (a new epoch). The KV cache memory is kept."""
        self.cached.clear()
        self.grammar.clear()
        self.prompt_logprobs.clear()
        self.pooling.clear()
        self.last_step = -1
        self._launched_drafts = False

    # -- one step ---------------------------------------------------------------------------
    # launch_step: apply the diff, stage every input (one copy per staging arena), forward,
    # sample, queue the read-back copies; no host sync. finish_step: the step's one host sync
    # (tests/gpu/test_no_host_sync.py checks both), then the sampled ids go into the batch.
    #
    # A launched step already counts its sampled tokens (num_tokens grows at launch; the ids
    # are written at finish), so step t+1 can be launched before step t is finished: its input
    # ids for the rows step t sampled are copied on the device from step t's sampler output
    # (a TokenFeed), and the device never waits for the host between the two (`pipelined`).

    def execute(self, payload: bytes) -> RunnerOutput:
        """Decode a diff, apply it, run the model and sample."""
        return self.execute_diff(self.decode(payload))

    def decode(self, payload: bytes) -> SchedulerOutput:
        """The diff in `payload`; BadDiff when it is larger than the batch limits allow."""
        if len(payload) > self.max_payload_bytes:
            raise BadDiff("payload size", len(payload), f"<= {self.max_payload_bytes} bytes "
                          "(the largest diff the batch limits allow)")
        return decode_scheduler_output(payload)

    def execute_diff(self, diff: SchedulerOutput) -> RunnerOutput:
        """launch_step, then finish_step."""
        return self.finish_step(self.launch_step(diff))

    def needs_host_tokens(self, diff: SchedulerOutput) -> bool:
        """Whether `diff` must see the previous step's sampled ids on the host before it is
        launched: grammar masks and penalties are computed from them, and a handle that leaves
        the batch and joins it again in `diff` changes rows (cached_requests.rejoins). Drafts
        too: a step after one with drafts starts where that one's accepted run ended, and
        drafts assumed over the step before are checked against its tokens (spec_verify.py)."""
        if self._launched_drafts or diff.spec_token_ids:
            return True
        if self.grammar or any(new.constraint is not None for new in diff.new_requests):
            return True
        if rejoins(diff):
            return True
        return history_needed(self.batch, diff.new_requests)

    @torch.inference_mode()
    def launch_step(self, diff: SchedulerOutput, feed: PendingStep | None = None) -> PendingStep:
        """Everything up to the token read-back, without a host sync. `feed`: the previous
        step when it is not finished yet (its sampled ids reach this step on the device)."""
        if diff.step != self.last_step + 1:
            raise StepProtocolError(f"step {diff.step} arrived after step {self.last_step}")
        if self.diff_bounds is None:
            raise StepProtocolError("no KV cache is allocated: Init first")
        self.clock.start()
        check_diff(diff, self.diff_bounds, self.requests, self.batch.handle_to_row,
                   self.batch.num_blocks, self.batch.window_num_blocks)
        self.last_step = diff.step
        self.staging = self._stagings[diff.step % 2]
        self.readback = self._readbacks[diff.step % 2]
        self._apply_diff(diff)
        inputs, spec = prepare_with_drafts(self.batch, self.cached, diff, self.block_size,
                                           self.grammar)
        self._launched_drafts = spec is not None
        if inputs.num_tokens == 0:
            return PendingStep(diff.step, computed=False)
        self.staging.check_fits(inputs.num_tokens, len(inputs.rows), inputs.block_table.shape[1])
        prompt = pool = None
        if self.simulated is None:
            prompt = self.prompt_logprobs.plan(self.batch, inputs)
            pool = self.pooling.plan(self.batch, inputs)
        try:
            return self._launch(diff.step, inputs, feed, prompt, pool, spec)
        except BaseException:
            self.staging.wait_copies()      # a failed step, too, ends after its copies
            raise

    def finish_step(self, pending: PendingStep) -> RunnerOutput:
        """The step's one host sync, then the sampled ids into the batch and the reply, with
        the handles whose grammar compiled since (a step that computed nothing waits up to
        _IDLE_COMPILE_WAIT_S for one: no spinning while a constraint compiles) or failed."""
        if pending.tokens is None:
            self._stagings[pending.step % 2].wait_copies()
            self.clock.mark("readback")
            out = RunnerOutput(step=pending.step)
        else:
            sampled = pending.tokens.wait()
            self.clock.mark("readback")
            out = self._record_samples(pending, sampled)
        self.prompt_logprobs.finish(pending.prompt_logprobs, out)
        self.pooling.finish(pending.pooling, out)
        out.compiled_handles = self.grammar.newly_compiled(
            0.0 if pending.computed else _IDLE_COMPILE_WAIT_S)
        out.request_errors = self.grammar.take_errors()
        return out

    def _launch(self, step: int, inputs: StepInputs, feed: PendingStep | None,
                prompt=None, pool=None, spec=None) -> PendingStep:
        """`prompt`, `pool`, `spec`: the step's prompt-logprob, pooling and draft work (each
        None when it has none)."""
        self.staging.begin()
        taps = [t for t in (prompt, pool) if t is not None]
        run_model, input_ids = self._stage_model(inputs, taps, spec, pool)
        sample_rows = inputs.rows[inputs.sample_mask]
        meta = masks = walks = None
        # Structured output only: the constrained rows' masks, computed beside the forward.
        handles = self.batch.handle_ids[sample_rows].tolist()
        if len(sample_rows):
            draw_rows, known, done = sample_rows, None, self.grammar.stopped(handles)
            if spec is not None:     # also a draw at every draft position (spec_verify.py)
                walks = spec.walk_grammars(self.batch, self.grammar) if self.grammar else None
                draw_rows, known, done = spec.sampling_rows(self.batch, sample_rows, done,
                                                            walks)
            meta = build_sampling_metadata(self.batch, draw_rows, self.vocab_size,
                                           self.staging, done, known)
            if self.grammar:
                allowed = self.batch.id_sets["allowed_token_ids"]
                masks = self.grammar.start_masks(handles, bias=self.device.type == "cpu",
                                                 allowed=[allowed[r] for r in sample_rows],
                                                 walks=walks, num_draws=len(draw_rows))
        fed = feed and TokenFeed.plan(feed, self.batch.handle_ids, inputs, self.staging,
                                      self.batch.layout)
        self.staging.flush()
        if fed is not None and self.simulated is None:
            fed.apply(input_ids)
        self.clock.mark("input_prep")
        try:
            out, is_hidden = run_model() if self.simulated is None else (None, False)
            self.clock.mark("forward")
        finally:
            masks = masks and masks.result()   # the grammar masks, computed meanwhile
        self.batch.num_computed[inputs.rows] += inputs.num_scheduled
        if meta is None:
            # computed, sampled nothing
            return PendingStep(step, copied=self.staging.copied, prompt_logprobs=prompt,
                               pooling=pool)
        if masks is not None:
            meta = with_grammar_masks(meta, masks, self.device, self.vocab_size)
        if self.on_sampling is not None:
            self.on_sampling()
        positions = self.batch.num_tokens[sample_rows].copy()
        self.batch.num_tokens[sample_rows] += 1            # the ids follow at finish_step
        num_logprobs = self.batch.num_logprobs[sample_rows].copy()
        if self.simulated is not None:
            self.clock.mark("sampling")
            return PendingStep(step, handles, positions, num_logprobs,
                               self.simulated.sample(positions), rows=sample_rows,
                               layout=self.batch.layout)
        sampled = self.sampler.from_model_output(out, is_hidden, meta, self.model)
        self.clock.mark("sampling")
        return PendingStep(step, handles, positions, num_logprobs, self.readback.start(sampled),
                           sampled.sampled_token_ids, rows=sample_rows,
                           layout=self.batch.layout, prompt_logprobs=prompt, spec=spec,
                           pooling=pool)

    def _stage_model(self, inputs: StepInputs, taps: list = (), spec=None, pool=None
                     ) -> tuple[Callable, torch.Tensor]:
        """Stage the model inputs; returns the call (made after the flush) that runs the model
        and the device view of the staged input ids (a TokenFeed fills rows of it). The call
        gives the sampling rows' hidden states and True (the sampler applies the LM head, or
        on CUDA a plain greedy step samples straight from model-dtype logits), from a captured
        graph for a pure-decode batch that fits one, else from the eager model (then each of
        the step's `taps` reads every token row: prompt logprobs, pooling; and the rows of
        the `spec` step's draft positions follow the sampling rows; the `pool` step's
        sentence pairs give the model their token types)."""
        n = len(inputs.rows)
        g = self.graph_runner
        if not taps and spec is None and g is not None and g.graph_batch(
                n, inputs.num_tokens, int(inputs.num_scheduled.max())) is not None:
            staged = g.stage(n, inputs.input_ids, inputs.positions, inputs.slot_mapping,
                             inputs.seq_lens, inputs.block_table, self.staging)
            if inputs.sample_mask.all():
                return (lambda: (g.replay_hidden(staged), True)), staged.tokens[0]
            # Pure decode: query row i is request i, so logits_indices are the sampling rows.
            keep = self.staging.put(inputs.logits_indices, torch.int64, "logits_indices")
            return (lambda: (g.replay_hidden(staged).index_select(0, keep), True)), \
                staged.tokens[0]
        staged = stage_step_inputs(self.staging, inputs)
        meta = attention_metadata(inputs, staged)
        if self.lora is not None:
            self.lora.set_rows(self.batch.lora_slots[inputs.rows], inputs.num_scheduled)

        types = pool and pool.token_type_ids(staged.input_ids.shape[0], self.device)
        extra = {} if types is None else {"token_type_ids": types}

        def run_eager() -> tuple[torch.Tensor, bool]:
            hidden = self.model(staged.input_ids, staged.positions, self.kv_caches, meta,
                                **extra)
            for tap in taps:
                tap.launch(hidden, self.model)
            rows = staged.logits_indices if spec is None else spec.logits_rows(
                staged.logits_indices)
            return hidden.index_select(0, rows), True
        return run_eager, staged.input_ids

    def _apply_diff(self, diff: SchedulerOutput) -> None:
        """The diff on the cached requests and the batch, then on the books of each."""
        check_lora_ids(diff.new_requests, self.lora)
        self.pooling.check_new(diff.new_requests)
        self.cached.apply(diff)
        self.prompt_logprobs.apply(diff)
        self.pooling.apply(diff)
        self.grammar.apply(diff, self.requests)

    def _record_samples(self, pending: PendingStep, sampled: SampledTokens) -> RunnerOutput:
        """Write the sampled ids into the batch and the cached states; build the reply. A
        request finished or preempted since the launch still gets its token in the reply; a
        drafted one gets its accepted drafts and one more (spec_verify.py)."""
        handles, rows, positions = pending.handles, pending.rows, pending.positions
        same_rows = pending.layout == self.batch.layout     # no row changed hands since
        ids, logprobs = sampled.token_ids, sampled.logprobs
        if pending.spec is None:
            top = top_alternatives(handles, pending.num_logprobs, sampled)
        else:      # finished before the next launch: the launch's rows
            handles, rows, positions, draws, counts = pending.spec.accept(
                self.batch, handles, rows, positions, ids)
            top = top_alternatives(pending.handles, pending.num_logprobs, sampled, draws, counts)
            ids, logprobs = ids[draws], (logprobs[draws] if len(logprobs) else logprobs)
        token_ids = self.cached.record(handles, positions, ids, rows if same_rows else None)
        self.grammar.advance(handles, token_ids)
        return RunnerOutput(pending.step, handles, token_ids, logprobs, top)
