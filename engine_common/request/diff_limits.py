"""Hard bounds on what one step diff may carry, shared by the scheduler (which never sends more)
and the worker (which refuses more before touching a tensor: worker_service/batch/diff_check.py).

The per-epoch bounds come from the batch limits both sides share (max_num_seqs,
max_num_batched_tokens, max_model_len, block_size); these constants bound the rest.
"""
from __future__ import annotations

from engine_common.request.params import KNOBS
from engine_common.request.sampling_knobs import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS  # noqa: F401 (bounds)

MIN_MODEL_LEN = 2               # max_model_len's floor: a prompt token and an output token (a
                                # prompt holds at most max_model_len - 1); 1 was accepted, then
                                # every request was refused
MAX_HANDLE = 2**31 - 1          # handles are small recycled integers; uint32 on the wire
MAX_SEED = 2**63 - 1            # int64 on the worker
MAX_MIN_TOKENS = 2**31 - 1      # int32 on the worker
MAX_STOP_TOKEN_IDS = 1024       # stop_token_ids of one request (the public API's bound)
MAX_STOP_IDS = MAX_STOP_TOKEN_IDS + 64   # + the model's eos ids, as the worker receives them
MAX_TOP_LOGPROBS = 256          # top alternatives per token (the public API's bound)
MAX_CONSTRAINT_CHARS = 1 << 16  # characters of one structured-output constraint (the public
                                # API's --max-constraint-chars is at most this)
MAX_CONSTRAINT_CHOICES = 10_000  # choices of one `choice` constraint: llguidance's work grows
                                # with them (20,000 one-character choices: 1.8 s to compile +
                                # 4.8 s for the first mask on SmolLM2's vocabulary), and past
                                # 50,000 its first mask always fails (its per-step item limit)
MAX_WAITING = 1 << 16           # ceiling of the scheduler's max_waiting (its waiting queue is a
                                # sorted list: O(n) inserts); it bounds the worker's cache below
MAX_CONSTRAINT_DEPTH = 1000     # nesting of one constraint (engine_common/constraints/constraint_depth.py):
                                # llguidance recurses <= 4.1 KB a level, so 1000 levels take
                                # half of an 8 MiB stack; it runs on 64 MiB ones (big_stack.py)
MAX_REGEX_REPEAT_SIZE = 10_000  # atoms the counted repetitions of a regex add once written
                                # out (engine_common/constraints/regex_size.py): the
                                # worker's lexer expands them (a{100000}: 36 ms a mask; a{1000000}
                                # spent all its fuel and failed the request's first mask)

# Bytes of the encoded parts (engine_common/wire/codec.py), rounded up: a msgpack integer <= 9, an
# array, map or bytes header <= 5. The sampling knobs travel as a SamplingParams protobuf message
# holding each knob at most once: a field tag <= 2 bytes, then a varint <= 10 or a double 8, or
# for a set of ids a length <= 5 and <= 5 bytes an id.
_INT = 9
_HEADER = 5
_TAG = 2
_SAMPLING = _HEADER + sum(_TAG + (5 + k.meta.max_ids * 5 if k.meta.ids else 10) for k in KNOBS)
_SLACK = 1 << 20                # finished and preempted handles, the step number, headers
# A constraint [kind, value]: <= 4 UTF-8 bytes a character plus string headers. A choice of c
# characters takes <= 4c bytes and a header of 1 byte (<= 31 bytes), 2 or 3 (c >= 8) or 5
# (c > 16384): <= 5c in all, the worst being one-character choices. So <= 5 bytes a character.
_CONSTRAINT = 3 * _HEADER + 16 + 5 * MAX_CONSTRAINT_CHARS
# logit_bias: a map entry of the SamplingParams message each: its tag and length (2 bytes), the
# id (a tag and a varint <= 5) and the bias (a tag and a double).
_LOGIT_BIAS = MAX_LOGIT_BIAS * (2 + 1 + 5 + 1 + 8)


def max_cached_requests(max_num_seqs: int) -> int:
    """The most requests a worker may cache (running or preempted) under this max_num_seqs.

    A worker caches exactly the requests its scheduler has sent and not yet finished: those
    running (<= max_num_seqs) and those preempted back into the waiting queue. A preempted
    request holds no KV blocks, so the cache cannot bound them; the scheduler's admission does:
    a request is queued only while fewer than max_waiting wait, and preemption and resumption
    only move requests between the batch and the queue, so running + waiting never exceeds
    max_num_seqs + max_waiting (scheduler_service/core/scheduler.py). The worker does not know
    max_waiting (a scheduler setting), so it allows its ceiling, MAX_WAITING."""
    return max_num_seqs + MAX_WAITING


def max_blocks_per_request(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def max_diff_bytes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                   block_size: int) -> int:
    """An upper bound on the encoded size of any legal step diff under these limits.

    At most min(max_num_seqs, max_num_batched_tokens) requests join in one step, each sent
    whole: its prompt (< max_model_len uint32 ids), block ids, stop ids, sampling, a
    constraint of up to MAX_CONSTRAINT_CHARS characters and its scalars (prompt_logprobs the
    ninth). Every seat may also be resumed, get new blocks and a token count, and speculative
    drafts (each a scheduled token: at most max_num_batched_tokens ids in all) with what they
    assume of the step in flight (spec_assumed: a key and two ints).
    """
    blocks = max_blocks_per_request(max_model_len, block_size) * _INT + _HEADER
    new = (4 * max_model_len + _HEADER + blocks + MAX_STOP_IDS * _INT + _SAMPLING + 9 * _INT
           + _CONSTRAINT + _LOGIT_BIAS)
    joining = min(max_num_seqs, max_num_batched_tokens)
    per_seat = 2 * (blocks + 2 * _INT) + 2 * _INT
    drafts = max_num_batched_tokens * _INT + max_num_seqs * (2 * _INT + 2 * _HEADER + 2 * _INT)
    return joining * new + max_num_seqs * per_seat + drafts + _SLACK
