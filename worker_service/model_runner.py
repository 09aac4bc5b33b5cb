"""The model runner: applies each step's diff to its cached requests, runs the model, samples.

Every rank runs the same runner on the same diffs and samples the same tokens (seeded noise keyed
by request and position), so sampled ids never travel between ranks: each rank feeds them back
into its own persistent batch.
"""
from __future__ import annotations

import hashlib
import logging

import numpy as np
import torch

from engine_common.codec import decode_scheduler_output
from engine_common.diff import RunnerOutput, SchedulerOutput
from engine_common.model_dir import ModelInfo
from kernels.attention.backend import AttentionMetadata
from kernels.attention.selector import CacheLayout, get_attention_backend, resolve_backend_name
from worker_service.cached_request import CachedRequestState
from worker_service.config import RunnerConfig
from worker_service.cuda_graphs import DecodeGraphRunner, graphs_unsupported_reason
from worker_service.input_batch import InputBatch
from worker_service.kv_profiler import (KVMemoryProfile, cpu_num_kv_blocks, make_decode_warmup,
                                        make_prefill_warmup, profile_kv_memory)
from worker_service.model_loader import load_model, resolve_dtype
from worker_service.parallel_state import TPGroup, single_rank_group
from worker_service.sampler import Sampler
from worker_service.sampling_inputs import build_sampling_metadata
from worker_service.sampling_metadata import worst_case_sampling_metadata
from worker_service.step_inputs import StepInputs, StepProtocolError, prepare_step_inputs

log = logging.getLogger(__name__)


def _cache_layout(hf_config: dict, config: RunnerConfig) -> CacheLayout:
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    return CacheLayout(config.block_size, head_dim, resolve_dtype(hf_config, config.dtype))


class ModelRunner:
    def __init__(self, config: RunnerConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or single_rank_group()
        self.device = torch.device(config.device)
        info = ModelInfo.from_dir(config.model_dir, config.max_model_len)
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        layout = _cache_layout(info.hf_config, config)
        self.attention_backend_name = resolve_backend_name(config.attention_backend,
                                                           self.device.type, layout)
        backend = get_attention_backend(self.attention_backend_name, self.device.type, layout)
        self.model = load_model(config.model_dir, self.tp, backend, self.device, config.dtype,
                                fused_ops=config.fused_ops)
        self.sampler = Sampler()
        self.block_size = config.block_size
        max_blocks = -(-self.max_model_len // self.block_size)
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, max_blocks)
        self.requests: dict[int, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner: DecodeGraphRunner | None = None
        self.last_step = -1

    # -- KV cache ---------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block takes across all layers on this rank (keys and values)."""
        m = self.model
        elem = torch.empty((), dtype=self.model_dtype).element_size()
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * elem

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def determine_num_blocks(self, gpu_memory_utilization: float | None = None) -> int:
        """KV blocks this rank can hold: num_kv_blocks when set; on CUDA with a utilization, a
        profiled share of the device (call with no cache allocated); else the byte budget."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if gpu_memory_utilization is None or self.device.type != "cuda":
            return cpu_num_kv_blocks(self.config.kv_cache_bytes, self.kv_block_bytes)
        profile = self.profile_kv_memory(gpu_memory_utilization)
        log.info("KV memory on %s: %s", self.device, profile)
        return profile.num_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache, then capture decode CUDA graphs over it where they apply."""
        self.free_kv_cache()
        m = self.model
        shape = (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.model_dtype, device=self.device)
                          for _ in range(m.num_layers)]
        why_not = graphs_unsupported_reason(self.attention_backend_name, self.device,
                                            self.config.enforce_eager)
        if why_not is not None:
            log.info("decode CUDA graphs off: %s", why_not)
            return
        self.graph_runner = DecodeGraphRunner(
            self.model, self.kv_caches, self._max_graph_batch, self.batch.block_table.shape[1],
            self.max_model_len, self.device)
        self.graph_runner.capture()

    def free_kv_cache(self) -> None:
        """Drop the cache and the graphs captured over it (they hold its memory and pool)."""
        self.graph_runner = None
        self.kv_caches = []

    @property
    def _max_graph_batch(self) -> int:
        return min(self.config.max_graph_batch, self.config.max_num_seqs)

    def profile_kv_memory(self, gpu_memory_utilization: float) -> KVMemoryProfile:
        """CUDA: what the KV cache may take after a profiled warm-up at the largest step (and
        the largest graphed decode batch), as nano-vllm sizes it. Call with no cache allocated;
        every tensor-parallel rank must call it together (the warm-up runs collectives)."""
        c = self.config
        def sample(logits: torch.Tensor) -> None:
            self.sampler.forward(logits, worst_case_sampling_metadata(
                logits.shape[0], self.vocab_size, self.device))

        warmup = make_prefill_warmup(self.model, self.block_size, c.max_num_batched_tokens,
                                     c.max_num_seqs, self.max_model_len, self.device, sample)
        graph_warmup = None
        if graphs_unsupported_reason(self.attention_backend_name, self.device,
                                     c.enforce_eager) is None:
            graph_warmup = make_decode_warmup(self.model, self.block_size, self._max_graph_batch,
                                              self.max_model_len, self.device)
        return profile_kv_memory(warmup, self.kv_block_bytes, gpu_memory_utilization,
                                 self.device, graph_warmup)

    def state_digest(self, out: RunnerOutput) -> bytes:
        """BLAKE2b (16 bytes) of this step's sampled ids and the cached state: per batch row the
        handle, num_computed, num_tokens and last token id. Equal on every rank while the ranks
        agree (verify_symmetry); nothing in it depends on the rank or the TP size."""
        b, n = self.batch, self.batch.num_reqs
        rows = np.arange(n)
        last = b.token_ids[rows, np.maximum(b.num_tokens[:n], 1) - 1]
        h = hashlib.blake2b(digest_size=16)
        for part in (out.handles, out.sampled_token_ids,
                     [-1 if x is None else x for x in b.handles[:n]],
                     b.num_computed[:n], b.num_tokens[:n], last):
            h.update(np.asarray(part, dtype=np.int64).tobytes())
            h.update(b"|")
        return h.digest()

    def reset(self) -> None:
        """Drop every cached request (a new epoch). The KV cache memory is kept."""
        for handle in list(self.batch.handle_to_row):
            self.batch.remove(handle)
        self.batch.condense()
        self.requests.clear()
        self.last_step = -1

    # -- one step ---------------------------------------------------------------------------

    def execute(self, payload: bytes) -> RunnerOutput:
        """Decode a diff, apply it, run the model and sample."""
        return self.execute_diff(decode_scheduler_output(payload))

    @torch.inference_mode()
    def execute_diff(self, diff: SchedulerOutput) -> RunnerOutput:
        if diff.step != self.last_step + 1:
            raise StepProtocolError(f"step {diff.step} arrived after step {self.last_step}")
        self.last_step = diff.step
        self._apply_diff(diff)
        num_scheduled = np.ones(self.batch.num_reqs, dtype=np.int32)
        for handle, n in diff.num_scheduled_tokens.items():
            num_scheduled[self._row(handle)] = n
        inputs = prepare_step_inputs(self.batch, num_scheduled, self.block_size)
        if inputs.num_tokens == 0:
            return RunnerOutput(step=diff.step)
        logits = self._forward(inputs)
        self.batch.num_computed[inputs.rows] += inputs.num_scheduled
        sample_rows = inputs.rows[inputs.sample_mask]
        if len(sample_rows) == 0:
            return RunnerOutput(step=diff.step)
        meta = build_sampling_metadata(self.batch, sample_rows, self.vocab_size, self.device)
        sampled = self.sampler.forward(logits, meta)
        return self._record_samples(diff.step, sample_rows, sampled)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of the rows that sample: a captured graph for a pure-decode batch that fits
        one, else the eager model."""
        n = len(inputs.rows)
        g = self.graph_runner
        if g is not None and g.graph_batch(n, inputs.num_tokens,
                                           int(inputs.num_scheduled.max())) is not None:
            logits = g.run(n, inputs.input_ids, inputs.positions, inputs.slot_mapping,
                           inputs.seq_lens, inputs.block_table)
            # Pure decode: query row i is request i, so sampling rows index logits directly.
            return logits if inputs.sample_mask.all() else logits[
                torch.from_numpy(np.flatnonzero(inputs.sample_mask)).to(self.device)]
        hidden = self.model(torch.from_numpy(inputs.input_ids).to(self.device),
                            torch.from_numpy(inputs.positions).to(self.device),
                            self.kv_caches, self._attention_metadata(inputs))
        return self.model.compute_logits(
            hidden[torch.from_numpy(inputs.logits_indices).to(self.device)])

    def _row(self, handle: int) -> int:
        try:
            return self.batch.handle_to_row[handle]
        except KeyError:
            raise StepProtocolError(f"handle {handle} is not in the running batch") from None

    def _apply_diff(self, diff: SchedulerOutput) -> None:
        for handle in diff.finished_handles:
            if handle in self.batch.handle_to_row:
                self.batch.remove(handle)
            self.requests.pop(handle, None)
        for handle in diff.preempted_handles:
            self.batch.remove(handle)  # keeps self.requests[handle]: its tokens are recomputed
        for new in diff.new_requests:
            state = CachedRequestState(new.handle, list(new.prompt_token_ids), new.sampling,
                                       list(new.block_ids), new.num_computed_tokens,
                                       new.num_logprobs)
            self.requests[new.handle] = state
            self.batch.add(state)
        for res in diff.resumed_requests:
            state = self.requests[res.handle]
            state.block_ids = list(res.block_ids)
            state.num_computed_tokens = res.num_computed_tokens
            self.batch.add(state)
        for handle, block_ids in diff.new_block_ids.items():
            self.requests[handle].block_ids.extend(block_ids)
            self.batch.append_block_ids(self._row(handle), block_ids)
        self.batch.condense()

    def _attention_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        dev = self.device
        qsl = torch.from_numpy(inputs.query_start_loc)
        seq_lens = torch.from_numpy(inputs.seq_lens)
        return AttentionMetadata(
            num_reqs=len(inputs.rows), num_actual_tokens=inputs.num_tokens,
            max_query_len=int(inputs.num_scheduled.max()),
            max_seq_len=int(inputs.seq_lens.max()),
            query_start_loc=qsl.to(dev), seq_lens=seq_lens.to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(inputs.block_table)).to(dev),
            slot_mapping=torch.from_numpy(inputs.slot_mapping).to(dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)

    def _record_samples(self, step: int, rows: np.ndarray, sampled) -> RunnerOutput:
        """Feed sampled ids back into the batch and the cached states; build the reply."""
        token_ids = sampled.sampled_token_ids.cpu().numpy()
        self.batch.append_tokens(rows, token_ids)
        handles = [self.batch.handles[r] for r in rows]
        for handle, tok in zip(handles, token_ids.tolist()):
            self.requests[handle].output_token_ids.append(tok)
        top = {}
        if sampled.top_ids is not None:
            top_ids = sampled.top_ids.cpu().tolist()
            top_lps = sampled.top_logprobs.cpu().tolist()
            for i, row in enumerate(rows):
                k = int(self.batch.num_logprobs[row])
                if k:
                    top[handles[i]] = (top_ids[i][:k], top_lps[i][:k])
        return RunnerOutput(step=step, handles=handles, sampled_token_ids=token_ids.tolist(),
                            logprobs=sampled.logprobs.cpu().tolist(), top_logprobs=top)
