"""The KV-memory profile of a ModelRunner on CUDA: a warm-up at its largest step with the
sampler's worst case (and its largest graphed decode batch), measured by kv_profiler."""
from __future__ import annotations

import torch

from worker_service.lora.load import lora_slots
from worker_service.runner.lora_memory import lora_flags_text
from worker_service.runner.kv_profiler import (KVMemoryProfile, make_decode_warmup,
                                               make_prefill_warmup, profile_kv_memory)
from worker_service.sample.sampling_metadata import worst_case_sampling_metadata
from worker_service.step.cuda_graphs import graphs_unsupported_reason


def profile_runner(runner, gpu_memory_utilization: float) -> KVMemoryProfile:
    """What the KV cache of `runner` (a ModelRunner with no cache allocated) may take."""
    c = runner.config

    def sample(logits: torch.Tensor) -> None:
        runner.sampler.forward(logits, worst_case_sampling_metadata(
            logits.shape[0], runner.vocab_size, runner.device))

    warmup = make_prefill_warmup(runner.model, runner.block_size, c.max_num_batched_tokens,
                                 c.max_num_seqs, runner.max_model_len, runner.device, sample)
    graph_warmup = None
    if graphs_unsupported_reason(runner.attention_backend_name, runner.device,
                                 c.enforce_eager, runner.model) is None:
        graph_warmup = make_decode_warmup(runner.model, runner.block_size,
                                          runner._max_graph_batch, runner.max_model_len,
                                          runner.device)
    held = runner.lora.stack_bytes() if runner.lora is not None else 0
    return profile_kv_memory(warmup, runner.kv_block_bytes, gpu_memory_utilization,
                             runner.device, graph_warmup,
                             max(0, runner.lora_bound_bytes - held),
                             lora_flags_text(c, lora_slots(c)))
