"""The client-facing output of the engine for one request and step (`RequestOutput`), its
logprob entries and timings, and how two consecutive outputs merge into one. The output
processor (output_processor.py) makes them; the serving side and the offline LLM read them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_common.wire.diff import PromptLogprobs
from scheduler_service.core.request import RequestStatus
from scheduler_service.errors import RequestFailed


@dataclass(slots=True)
class TokenLogprob:
    """One generated token: its logprob under the raw model distribution and the best
    alternatives (best first; at most the request's num_logprobs of them). Without
    alternatives both are the same empty tuple: one entry per generated token is kept, so an
    entry allocates nothing more than itself."""

    token_id: int
    logprob: float
    top_token_ids: list[int] | tuple[()] = ()
    top_logprobs: list[float] | tuple[()] = ()


@dataclass(slots=True)
class PromptLogprob:
    """One prompt position i >= 1: the logprob of prompt token i given the tokens before it
    (raw model distribution), its rank (1: the most likely; as vLLM's Logprob.rank) and the
    best alternatives there, best first (the request's prompt_logprobs of them; their ranks
    are 1, 2, ...)."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


def prompt_logprob_entries(prompt_ids: list[int], got: PromptLogprobs
                           ) -> list[PromptLogprob | None]:
    """vLLM's shape: one entry per prompt token, None for the first (nothing predicts it)."""
    k = got.k
    lps, ranks = [float(v) for v in got.logprobs], [int(r) for r in got.ranks]
    ids, tops = [int(t) for t in got.top_ids], [float(v) for v in got.top_logprobs]
    return [None] + [PromptLogprob(int(prompt_ids[i + 1]), lps[i], ranks[i],
                                   ids[i * k:(i + 1) * k], tops[i * k:(i + 1) * k])
                     for i in range(len(lps))]


class PromptLogprobList(Sequence):
    """A request's prompt logprobs in vLLM's shape (`prompt_logprob_entries`), built on first
    read. The output processor runs on the event loop in the server, and building the entries
    of a 100k-token prompt at k=20 takes ~0.8 s of CPU: the loop only passes this on (its len
    and truth are free); the servicers read it on a worker thread. Built at most once (two
    threads racing would build equal lists)."""

    __slots__ = ("_prompt_ids", "_got", "_entries")

    def __init__(self, prompt_ids: list[int], got: PromptLogprobs):
        self._prompt_ids = prompt_ids
        self._got = got
        self._entries: list[PromptLogprob | None] | None = None

    def entries(self) -> list[PromptLogprob | None]:
        if self._entries is None:
            self._entries = prompt_logprob_entries(self._prompt_ids, self._got)
        return self._entries

    def __len__(self) -> int:
        return len(self._got.logprobs) + 1

    def __getitem__(self, index):
        return self.entries()[index]

    def __iter__(self):
        return iter(self.entries())

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, PromptLogprobList)):
            return self.entries() == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"PromptLogprobList({len(self)} entries)"


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """monotonic seconds; None until it happened. Immutable: outputs share one until a time
    changes (a new one then), so a step allocates none for most requests."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    first_scheduled_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request. `num_output_tokens` is cumulative; finish_reason
    and stop_reason are set only on the final output. `error` is set (on a final output with
    finish_reason FINISHED_ABORTED) when processing this request's output failed."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: RequestStatus | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    timings: RequestTimings
    error: RequestFailed | None = None
    # Set on the request's first output when it asked for prompt logprobs (vLLM's shape:
    # None first; built when first read); None otherwise.
    prompt_logprobs: PromptLogprobList | list[PromptLogprob | None] | None = None
    # A pooling request's vector, on its one (final) output; None otherwise.
    embedding: list[float] | None = None


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for two consecutive outputs of a request (tokens, text and logprobs in
    order; the later one's totals, timings and finish)."""
    return merge_run([first, later])


def merge_run(outputs: list[RequestOutput]) -> RequestOutput:
    """One output for consecutive outputs of a request, as merging them two by two would give,
    in time linear in their size: a lagging stream's pile (thousands of steps) merged pairwise
    copied its tokens again at each step, seconds of the event loop for 20,000 steps."""
    if len(outputs) == 1:
        return outputs[0]
    token_ids, logprobs = [], []
    prompt_logprobs = None
    for out in outputs:
        token_ids += out.new_token_ids
        logprobs += out.logprobs
        if not prompt_logprobs:
            prompt_logprobs = out.prompt_logprobs
    last = outputs[-1]
    return RequestOutput(last.request_id, token_ids, "".join(o.new_text for o in outputs),
                         logprobs, last.finished, last.finish_reason, last.stop_reason,
                         last.num_prompt_tokens, last.num_output_tokens,
                         last.num_cached_tokens, last.timings, last.error,
                         prompt_logprobs or last.prompt_logprobs, last.embedding)
