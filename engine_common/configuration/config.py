"""Configuration, one frozen dataclass per concern, each setting declared once (settings.py).

    BatchLimits          the batch sizes both sides size themselves by
    ├── SchedulerConfig  the continuous-batching policy (scheduler only)
    └── WorkerConfig     what every worker loads at Init (sent as worker.proto's WorkerConfig)
    WorkerServiceOptions one worker process's own flags (device, layout, timeouts)

Values derived at run time (the number of KV-cache blocks that fit in device memory, the model's
max_position_embeddings when max_model_len is unset) are never written back into a config by
the code that derives them: they travel as separate arguments or result objects.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass

from engine_common.configuration.listen_address import ListenAddress
from engine_common.configuration.speculative import SpeculativeConfig, parse_speculative_config
from engine_common.configuration.lora import MAX_LORA_ID, LoRAModule, parse_lora_modules
from engine_common.request.diff_limits import MAX_WAITING, MIN_MODEL_LEN
from engine_common.request.params import ParamError
from engine_common.configuration.settings import (AtLeast, AtLeastZero, NonEmpty, OneOf, Positive,
                                    PowerOfTwo, Rule, setting, validate)

DTYPES = ("auto", "bfloat16", "float16", "float32")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn", "cpu")
CPU_QUANTIZED_WEIGHTS = ("native", "dequantize")
# vLLM's --kv-cache-dtype names (fp8: e5m2 on CPU as vLLM-CPU, e4m3 on CUDA as vLLM; kv_dtype.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e5m2", "fp8_e4m3")
GIB = 1 << 30
# When unset, a long prefill is one with more than 512 tokens left (a step of ~512 prompt tokens
# stays short next to a full 2048-token one, and matmuls stay efficient), or the whole budget
# when that is smaller, or a quarter of the budget when that is larger: 4096 at CUDA's 16384. A
# fixed 512 there made half of nano-vllm's prompts (100-1024 tokens) long prefills, prefilled one
# at a time: 135 steps with prefill instead of 9, 13.9K instead of 15.5K tok/s on an H100
# (bench/results.md).
_LONG_PREFILL_DEFAULT = 512
_LONG_PREFILL_SHARE = 4


def gib_to_bytes(text: str) -> int:
    """A --kv-cache-gib value in bytes. argparse prints an ArgumentTypeError's own text (a
    ValueError only as "invalid gib_to_bytes value"); inf was an OverflowError traceback."""
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not (gib > 0 and math.isfinite(gib)):
        raise argparse.ArgumentTypeError(f"--kv-cache-gib={text} is invalid: must be a finite "
                                         "number of GiB > 0")
    return int(gib * GIB)


MAX_NUM_SEQS = 65536
INT32_MAX = 2**31 - 1


@dataclass(frozen=True, kw_only=True)
class BatchLimits:
    """Limits of one step and one request, shared by the scheduler and the workers."""

    # Upper bounds: a worker sizes per-row buffers by max_num_seqs, and the wire carries these
    # as 32-bit integers (a value past them was blamed on another flag, or overflowed).
    max_num_seqs: int = setting(256, "requests in the running batch",
                                rule=AtLeast(1, MAX_NUM_SEQS), wire=10)
    max_num_batched_tokens: int = setting(
        2048, "tokens (prefill chunks + decodes) in one step; >= --max-num-seqs",
        rule=AtLeast(1, INT32_MAX), wire=11)
    max_model_len: int | None = setting(
        None, "prompt + output tokens of one request; unset: the model's "
        "max_position_embeddings", rule=AtLeast(MIN_MODEL_LEN, INT32_MAX), wire=4)
    block_size: int = setting(16, "tokens per KV-cache block, a power of two",
                              rule=PowerOfTwo(1024), wire=5)
    # LoRA (docs/lora.md), vLLM's flags: the scheduler maps adapter names to ids, every worker
    # rank loads the same adapters at start.
    enable_lora: bool = setting(False, "serve the LoRA adapters of --lora-modules",
                                  wire=16)
    lora_modules: str | None = setting(
        None, "LoRA adapters, whitespace-separated: name=path (a PEFT directory) or vLLM's "
        "JSON form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'",
        metavar="NAME=PATH", wire=17)
    max_loras: int = setting(1, "distinct LoRA adapters in one step", rule=AtLeast(1, 64),
                             wire=18)
    max_lora_rank: int = setting(16, "largest LoRA rank r an adapter may have",
                                 rule=AtLeast(1, 512), wire=19)
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, as a flag: a public RPC that makes the server
    # read a path of its choice is the operator's decision (docs/security.md).
    allow_runtime_lora_updating: bool = setting(
        False, "serve LoadLoraAdapter / UnloadLoraAdapter: load and unload LoRA adapters at run "
        "time (needs --enable-lora)", wire=20)
    # vLLM's --max-cpu-loras (docs/lora.md, "Adapters the workers keep"): an LRU of the
    # adapters loaded on the workers; the others are read again from their path when wanted.
    # The workers get it too (the default filled in: lora_updates.init_config): their memory
    # check counts this many adapters' stacks.
    max_cpu_loras: int | None = setting(
        None, "LoRA adapters the workers keep loaded (an LRU, >= --max-loras; the others are "
        "read again from their directory when a request wants one); unset: with "
        "--allow-runtime-lora-updating the larger of --max-loras + 1 and the number of "
        "--lora-modules (vLLM's: --max-loras), else every --lora-modules adapter stays loaded",
        rule=AtLeast(1, MAX_LORA_ID), wire=24)

    def __post_init__(self):
        validate(self)
        # Every running request must be able to decode one token per step.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ParamError("max_num_batched_tokens", self.max_num_batched_tokens,
                             f">= max_num_seqs ({self.max_num_seqs})")
        if parse_lora_modules(self.lora_modules) and not self.enable_lora:
            raise ParamError("enable_lora", self.enable_lora, "true when lora_modules is set")
        if self.allow_runtime_lora_updating and not self.enable_lora:
            raise ParamError("enable_lora", self.enable_lora,
                             "true when allow_runtime_lora_updating is set")
        if self.max_cpu_loras is not None:
            if not self.enable_lora:
                raise ParamError("enable_lora", self.enable_lora,
                                 "true when max_cpu_loras is set")
            if self.max_cpu_loras < self.max_loras:
                raise ParamError("max_cpu_loras", self.max_cpu_loras,
                                 f"in [max_loras={self.max_loras}, {MAX_LORA_ID}]")

    @property
    def lora(self) -> tuple[LoRAModule, ...]:
        """The adapters of lora_modules (none without enable_lora)."""
        return parse_lora_modules(self.lora_modules) if self.enable_lora else ()


def limits_of(config: BatchLimits) -> dict:
    """The BatchLimits fields of a config, to give another config the same limits."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(BatchLimits)}


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(BatchLimits):
    """The continuous-batching policy. Chunked prefill is always on. The scheduler needs
    max_model_len set (the server fills in the model's)."""

    # At most MAX_WAITING: the workers' cache of preempted requests is bounded by it
    # (diff_limits.max_cached_requests), so a legal scheduler never exceeds that bound.
    max_waiting: int = setting(1024, "queued requests before new ones get RESOURCE_EXHAUSTED",
                               rule=AtLeast(1, MAX_WAITING))
    enable_prefix_caching: bool = setting(
        True, "reuse KV blocks of shared prompt prefixes", flag="--no-prefix-caching",
        aliases=("--no-enable-prefix-caching",))
    async_scheduling: bool = setting(
        False, "keep two steps in flight (three to workers that pipeline their steps): schedule "
        "step t+1 while the workers run step t (they feed their own sampled tokens back)")
    # Fairness under long prompts (docs/scheduler.md, "Long prompts"): a prompt longer than
    # the threshold is prefilled in chunks of at most that many tokens while any other request
    # is running or waiting, so it never takes a whole step from them.
    long_prefill_token_threshold: int | None = setting(
        None, "most prompt tokens one request prefills in a step while other requests run or "
        "wait (a longer prompt is a long prefill); unset: 512, or max_num_batched_tokens when "
        "smaller, or a quarter of it when that is larger",
        rule=AtLeast(1))
    max_long_partial_prefills: int = setting(
        1, "long prefills in progress at once; a further long prompt waits, shorter ones behind "
        "it are admitted", rule=AtLeast(1))
    # docs/speculative-decoding.md: n-gram drafts verified in one step (sync or async).
    speculative_config: str | None = setting(
        None, "speculative decoding as vLLM's JSON: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": K, \"prompt_lookup_max\": N, \"prompt_lookup_min\": M}'; "
        "unset: off")

    # vLLM's --seed: a request without a seed samples with one the scheduler draws; seeded,
    # those draws repeat, so a run's unseeded requests repeat in the same arrival order.
    seed: int | None = setting(
        None, "seeds the scheduler's draw of each unseeded request's seed: the same requests "
        "in the same order sample the same tokens (vLLM's --seed); unset: from the OS",
        rule=AtLeast(0, 2**63 - 1))

    def __post_init__(self):
        super().__post_init__()
        self.speculative       # parsed once here: a bad speculative_config is refused now
        threshold = self.long_prefill_threshold
        if self.max_long_partial_prefills * threshold > self.max_num_batched_tokens:
            raise ParamError("max_long_partial_prefills x long_prefill_token_threshold",
                             f"{self.max_long_partial_prefills} x {threshold}",
                             f"<= max_num_batched_tokens ({self.max_num_batched_tokens})")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config parsed (validated on construction); None: off."""
        return parse_speculative_config(self.speculative_config)

    @property
    def long_prefill_threshold(self) -> int:
        """long_prefill_token_threshold, or its default when unset."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        budget = self.max_num_batched_tokens
        return max(min(_LONG_PREFILL_DEFAULT, budget), budget // _LONG_PREFILL_SHARE)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(BatchLimits):
    """What every worker loads and how, sent in Init. A worker keeps a loaded model when only
    the KV budget or verify_symmetry changes."""

    model_dir: str = setting("", "model directory as the worker sees it", rule=NonEmpty(),
                             cli=False, wire=1)
    dtype: str = setting("auto", "weights and activations; auto: the model config's",
                         rule=OneOf(DTYPES), wire=2)
    attention_backend: str = setting(
        "auto", "attention kernels; auto: flash_attn when its paged layout fits, then triton "
        "on CUDA; on CPU the compiled paged kernel (cpu) when it is built and fits, then torch",
        rule=OneOf(ATTENTION_BACKENDS), wire=3)
    kv_cache_bytes: int | None = setting(
        None, "KV-cache bytes per device (the flag takes GiB); unset: 1 GiB unless "
        "gpu_memory_utilization is set",
        rule=AtLeast(1), wire=6, flag="--kv-cache-gib", parse=gib_to_bytes, metavar="GIB")
    gpu_memory_utilization: float | None = setting(
        None, "CUDA: the fraction of each GPU the worker may use in all (weights, activations, "
        "KV cache), in (0, 1]", rule=Positive(1.0), wire=7)
    verify_symmetry: bool = setting(
        False, "every rank digests its sampled ids and cached state each step; a mismatch "
        "fails the open requests and starts a new epoch", wire=12)
    enforce_eager: bool = setting(
        False, "run decode steps eagerly: no CUDA graphs (graphs are used on CUDA with the "
        "triton or flash_attn backend)", wire=13)
    max_graph_batch: int = setting(
        512, "largest decode batch captured as a CUDA graph: 1, 2, 4, 8, then steps of 16",
        rule=AtLeast(1), wire=14)
    fused_ops: bool = setting(
        False, "fused Triton RMSNorm, rotary embedding and SiLU-and-mul (CUDA; the device "
        "defaults turn it on there)", wire=15)
    cpu_quantized_weights: str = setting(
        "native", "GPTQ / AWQ checkpoints in a bfloat16 model on a CPU device: native keeps "
        "4-bit (and per-row 8-bit) linear weights packed and runs torch's weight-only int4 / "
        "int8 kernels; dequantize expands them to the model dtype at load (CUDA, and float32 "
        "/ float16 models, always do)",
        rule=OneOf(CPU_QUANTIZED_WEIGHTS), wire=22)
    disable_hybrid_kv_cache_manager: bool = setting(
        False, "one KV pool for a model that mixes sliding-window and full-attention layers, "
        "as vLLM's flag: every layer keeps every block of the context (better prefix-cache "
        "retention), instead of the window layers' own small pool", wire=21)
    kv_cache_dtype: str = setting(
        "auto", "KV cache element type, as vLLM's flag: auto keeps the model dtype; fp8 "
        "(e5m2 on CPU, e4m3 on CUDA), fp8_e5m2 and fp8_e4m3 store one byte per value with "
        "scale 1.0 (twice the blocks in the same --kv-cache-gib)",
        rule=OneOf(KV_CACHE_DTYPES), wire=23)

    def __post_init__(self):
        super().__post_init__()
        if self.kv_cache_bytes is not None and self.gpu_memory_utilization is not None:
            raise ParamError("gpu_memory_utilization", self.gpu_memory_utilization,
                             "unset when kv_cache_bytes is set (one KV budget)")

    @property
    def kv_budget_bytes(self) -> int:
        """The byte budget of the KV cache per device (1 GiB when unset)."""
        return GIB if self.kv_cache_bytes is None else self.kv_cache_bytes


class DeviceName(Rule):
    allowed = "auto, cpu, cuda or cuda:N"

    def ok(self, value) -> bool:
        return isinstance(value, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) is not None


@dataclass(frozen=True, kw_only=True)
class WorkerServiceOptions:
    """One worker process's own settings: where it runs and its place in the group."""

    device: str = setting("auto", "where the model runs; auto: cuda when available; with "
                          "several local ranks on cuda, rank r uses cuda:r", rule=DeviceName())
    local_ranks: int = setting(1, "rank processes (devices) of this worker; the tensor-parallel "
                               "size is nodes x local ranks (--tensor-parallel-size: vLLM's "
                               "name, the same on one node)", rule=AtLeast(1),
                               aliases=("--tensor-parallel-size", "-tp"))
    node_rank: int = setting(0, "this worker's index among the --nodes workers; node 0 holds "
                             "the output rank and comes first in the scheduler's --workers",
                             rule=AtLeast(0))
    nodes: int = setting(1, "worker services (nodes) in the tensor-parallel group",
                         rule=AtLeast(1))
    dist_timeout_s: float = setting(600.0, "seconds a rendezvous or a collective may take",
                                    rule=Positive(), flag="--dist-timeout")
    rank_step_timeout_s: float = setting(
        600.0, "seconds one step may take on the ranks before they count as stuck",
        rule=Positive(), flag="--rank-step-timeout")
    orphan_grace_s: float = setting(
        60.0, "seconds a worker keeps an epoch's requests and KV cache after its Step stream "
        "ended (the scheduler died) for a stream of the epoch to step again; then it drops "
        "them and the scheduler must Init", rule=Positive(hi=3600.0),
        flag="--worker-orphan-grace", metavar="S")
    metrics_listen: str | None = setting(
        None, "HOST:PORT of this worker's Prometheus /metrics endpoint (port 0: any free port), "
        "or off", rule=ListenAddress())
    # Guards of the Worker protocol (credentials: engine_common/security/worker_auth.py).
    model_root: str | None = setting(
        None, "Init may only name model directories under this directory (unset: any "
        "directory the worker can read)", metavar="DIR")
    max_message_mib: int = setting(
        256, "largest Worker message accepted, in MiB; Init refuses settings whose largest "
        "step diff would not fit", rule=AtLeast(1, 2047))
    insecure: bool = setting(
        False, "listen on a non-loopback address without --worker-token-file or "
        "--worker-tls-*: anyone who reaches the port can drive the worker")
    simulated_device_ms: float | None = setting(
        None, "benchmarks of the host's work only (bench/host_overhead.py): no forward pass "
        "or sampler; every step takes this many ms on a simulated device", rule=AtLeastZero())

    def __post_init__(self):
        validate(self)
        if self.node_rank >= self.nodes:
            raise ParamError("node_rank", self.node_rank, f"in [0, {self.nodes - 1}] "
                             f"(--nodes {self.nodes})")
