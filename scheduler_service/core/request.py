"""The scheduler's view of one request: its tokens, its progress and its status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.request.pooling import NO_POOLING


class RequestStatus(enum.IntEnum):
    """Order matters: every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_LENGTH = 3       # max_tokens or max_model_len reached
    FINISHED_STOP_TOKEN = 4   # eos or one of stop_token_ids
    FINISHED_STOP_STRING = 5  # a stop string matched in the text
    FINISHED_ABORTED = 6      # client cancel, deadline, or an error

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


@dataclass
class Request:
    """Read in the scheduler's per-step loops: keep every attribute a declared field and never
    touch `__dict__` (a materialised instance dict makes each attribute read ~1.7x slower)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    # Ids that end generation unless ignore_eos (from generation_config / config).
    eos_token_ids: tuple[int, ...] = ()
    # Top alternatives per output token, with the sampled token's own logprob; None: no logprob
    # at all (none computed on the workers, none in the outputs)
    num_logprobs: int | None = 0
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # What the output must match (structured output); validated at admission, sent to the
    # workers once with the new request.
    constraint: Constraint | None = None
    # The prefix cache's salt: cached blocks are shared only between requests of the same salt
    # (one per API key, or per group of keys; "" without keys). See kv_cache_manager.
    cache_salt: str = ""
    # Top alternatives per prompt position, with each prompt token's own logprob and rank
    # (vLLM's prompt_logprobs); None: none. Such a request skips the prefix cache.
    num_prompt_logprobs: int | None = None
    # An embedding request's pooling (engine_common/request/pooling.py, one int); NO_POOLING
    # for generation. Such a request computes its prompt, samples one token it never shows,
    # and finishes with its pooled vector (TokenUpdate.pooled).
    pooling: int = NO_POOLING
    # The LoRA adapter's id (engine_common/configuration/lora.py; 0: the base model), and its
    # load generation (core/lora_registry.py; 0: the id's), which salts the prefix cache:
    # requests of two adapters never share a block, of one adapter they do, and an adapter
    # loaded again under the same name and id never hits the blocks of the one before.
    lora_id: int = 0
    lora_generation: int = 0
    lora_name: str = ""     # its name, for the KV events (kv_events.BlockNamespace)

    # Set by the scheduler.
    handle: int = -1
    seed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV has been computed (or scheduled to be, once the step's output is processed).
    num_computed_tokens: int = 0
    # Tokens sampled by steps still in flight (async scheduling): the workers know them, the
    # scheduler does not yet. Each is one more token the next step may compute.
    num_pending_tokens: int = 0
    # Prompt tokens served from the prefix cache at first scheduling (reported in usage).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # A constrained request until the output rank reports its grammar compiled: its first
    # sampling position is not scheduled (the step would wait for the compile).
    awaiting_grammar: bool = False
    # Output tokens at which it ends for length: max_tokens, or fewer when the scheduler's
    # max_len (prompt + output tokens) comes first. Set when the scheduler queues it.
    max_num_output_tokens: int = 0
    stop_reason: int | str | None = None   # the stop token id or stop string that matched
    # Why an aborted request failed (its grammar failed on the worker), for its client; None
    # for a plain abort.
    error: str | None = None
    # Set to [] by an owner that reads only a request's final update (LLMEngine with final-only
    # outputs, for requests without stop strings or top alternatives): update_from_output then
    # makes no update per step, keeps each sampled token's logprob here, and the final update
    # carries every output token with these (TokenUpdate.final). None: an update every step.
    held_logprobs: list[float] | None = field(default=None, repr=False)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Ids that stop generation: eos unless ignore_eos, then stopping.stop_token_ids. Derived
    # once: neither changes after creation.
    stop_token_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # Ids the sampler masks until min_tokens is reached: eos (even with ignore_eos) and
    # stop_token_ids, as vLLM's SamplingParams.all_stop_token_ids, which its min_tokens logits
    # processor masks: ignore_eos lets eos through, it does not make it count toward min_tokens.
    min_tokens_stop_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # The prompt's ids as uint32 bytes, made by check_admission when every id fits (None
    # otherwise, or before admission): the prefix-cache hashes read it instead of converting
    # the prompt's list again. The prompt never changes after creation.
    prompt_u32: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        eos = () if self.stopping.ignore_eos else tuple(self.eos_token_ids)
        self.stop_token_ids = tuple(dict.fromkeys(eos + self.stopping.stop_token_ids))
        self.min_tokens_stop_ids = tuple(dict.fromkeys(
            tuple(self.eos_token_ids) + self.stopping.stop_token_ids))

    @property
    def prefix_salt(self) -> str:
        """The prefix cache's salt: cache_salt, and the adapter's generation when there is one."""
        if not self.lora_id:
            return self.cache_salt
        return f"{self.cache_salt}\0lora:{self.lora_generation or self.lora_id}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def ends_in_flight(self) -> bool:
        """Its pending tokens (async scheduling) already reach its output cap: it ends when they
        arrive (with drafts, unless some are rejected). A preempted one is then not resumed: up
        to two are in flight with three steps (engine_core.py), after its preemption too."""
        pending = self.num_pending_tokens
        return pending > 0 and len(self.output_token_ids) + pending >= self.max_num_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status.finished
