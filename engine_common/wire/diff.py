"""The step protocol's payloads: the SchedulerOutput diff and the worker's reply.

A diff says only what changed since the previous step. The worker applies its parts in this order:

    finished_handles   -> drop the cached request (its blocks are already freed)
    preempted_handles  -> take the request out of the batch, keep its tokens (recompute later)
    new_requests       -> cache the request and add it to the batch
    resumed_requests   -> put a preempted request back with a fresh block table
    new_block_ids      -> append blocks to running requests' tables
    new_window_block_ids -> (hybrid models only) append blocks to the window-group tables
    num_scheduled_tokens -> per-handle token counts for this step
    spec_token_ids     -> speculative drafts (docs/speculative-decoding.md): a handle's count is
                          then 1 + its drafts, which follow its last token as query tokens
    spec_assumed       -> (async scheduling) drafts proposed before the step in flight came
                          back: they stand only if the request then has that many tokens, the
                          last one as guessed; else the workers run the handle as one token

Every request in the batch that `num_scheduled_tokens` does not name is scheduled for exactly one
token: a decode step that feeds back the token the worker itself sampled last step. A count of 0
leaves a running request idle for the step. So steady-state decode is an almost empty message.
Requests are named by small integer handles that the scheduler recycles. On the wire,
new_block_ids is packed (engine_common/wire/new_blocks.py): about a byte per growing request plus a few
per run of consecutive block ids; in memory it is the plain map below.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine_common.constraints.constraint import Constraint
from engine_common.request.params import WorkerSamplingParams
from engine_common.request.pooling import NO_POOLING

# NewRequestData.num_logprobs of a request that wants no logprob at all (vLLM's logprobs=None):
# none is computed for it, and none comes back.
NO_LOGPROBS = -1


@dataclass(eq=False)
class NewRequestData:
    handle: int
    # A list where the scheduler builds it; a read-only numpy uint32 array where the codec
    # decoded it (the worker checks and copies it without a Python int per id).
    prompt_token_ids: list[int]
    sampling: WorkerSamplingParams
    block_ids: list[int]
    # Prompt tokens whose KV is already in the cache (prefix-cache hit), a multiple of block size.
    num_computed_tokens: int
    # Top alternatives to return per sampled token; with 0 or more the sampled token's logprob
    # comes back too. NO_LOGPROBS (-1): no logprob at all.
    num_logprobs: int = 0
    # Structured output: the workers compile it and mask every sampled token with it.
    constraint: Constraint | None = None
    # Top alternatives per prompt position, with the prompt token's own logprob and rank
    # (vLLM's prompt_logprobs); NO_LOGPROBS: none. Only with num_computed_tokens 0: the
    # scheduler skips the prefix cache for such a request, so every position is computed.
    prompt_logprobs: int = NO_LOGPROBS
    # A pooling (embedding) request's pooling (engine_common/request/pooling.py: type and
    # normalize as one int); NO_POOLING for generation. MEAN and CLS come with
    # num_computed_tokens 0 (no prefix hit), as prompt logprobs do.
    pooling: int = NO_POOLING
    # The LoRA adapter (docs/lora.md): its id, 1-based in --lora-modules; 0 the base model.
    lora_id: int = 0
    # The prompt's ids as uint32 bytes, where the scheduler already made them (at admission):
    # the codec writes them as they are instead of converting the ids again. Not compared.
    prompt_u32: bytes | None = field(default=None, compare=False, repr=False)

    def __eq__(self, other) -> bool:
        """Field by field, a prompt as its ids (an array equals the list of the same ids)."""
        if type(other) is not type(self):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name))
                   for f in fields(self) if f.compare)


@dataclass
class ResumedRequestData:
    """A preempted request scheduled again. Its block table is replaced, not appended to."""

    handle: int
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    step: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    resumed_requests: list[ResumedRequestData] = field(default_factory=list)
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    finished_handles: list[int] = field(default_factory=list)
    preempted_handles: list[int] = field(default_factory=list)
    # handle -> draft token ids (n-gram speculation): verified by the workers this step, which
    # reply with the accepted drafts and one more token, all under that handle, in order.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # handle -> [num_tokens, last token id] (async scheduling; every handle is in
    # spec_token_ids): the drafts were proposed assuming the request would hold num_tokens
    # tokens, ending with that id, once the step in flight is done. Where it does not, the
    # workers drop the drafts and compute the handle's one token where it really is.
    spec_assumed: dict[int, list[int]] = field(default_factory=dict)
    # handle -> block ids appended to its window-group table (a hybrid model's windowed
    # layers, engine_common/request/kv_groups.py); a new or resumed request's table starts
    # empty, so it gets its whole table here. Always empty for any other model.
    new_window_block_ids: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class PromptLogprobs:
    """A request's prompt logprobs, for positions 1 .. P-1 of its P prompt tokens (position 0
    has none): the prompt token's raw logprob and rank (1 + the ids more likely, ties counted
    as vLLM's), and the best `k` alternatives of each position, row-major [P-1, k], best first
    (their ranks are 1 .. k). numpy arrays on the runner side, lists once decoded."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[int]
    top_logprobs: list[float]

    @property
    def k(self) -> int:
        n = len(self.logprobs)
        return len(self.top_ids) // n if n else 0


@dataclass
class RunnerOutput:
    """What the output rank returns for one step: one entry per request that sampled a token.

    Requests in the middle of a chunked prefill sample nothing and are absent. A request with
    speculative drafts has one entry per token it produced (its accepted drafts, then the
    correction or bonus token), consecutive and in order.
    """

    step: int
    handles: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    # The model runner hands over its logprobs and top alternatives as numpy arrays, which
    # encode_runner_output writes as they are; decoded, they are lists.
    logprobs: list[float] = field(default_factory=list)
    # handle -> (token ids, logprobs) of the top alternatives, for requests that asked for them.
    top_logprobs: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    # Constrained requests whose grammar finished compiling on the output rank since its last
    # reply: the scheduler schedules their first sampling only after this.
    compiled_handles: list[int] = field(default_factory=list)
    # handle -> why that request alone failed on the output rank this step (its structured-output
    # grammar failed to compile, its matcher entered its error state, or no token was left to
    # sample): the scheduler ends it with that error and drops the token it sampled here.
    request_errors: dict[int, str] = field(default_factory=dict)
    # handle -> its whole prompt's logprobs, once, in the reply of the step where the request
    # samples its first token after its last prompt chunk was computed.
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    # handle -> a pooling request's pooled vector (float32 [hidden_size]), once, in the reply of
    # the step that computed its last prompt token (it samples nothing; the vector ends it).
    pooled: dict[int, list[float]] = field(default_factory=dict)


def _same(a, b) -> bool:
    if hasattr(a, "dtype") or hasattr(b, "dtype"):
        return len(a) == len(b) and list(a) == list(b)
    return a == b
