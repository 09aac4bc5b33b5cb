"""Classification and cross-encoder scoring on the scheduler side (deltaserve.v1 Classify and
Score; docs/scoring.md): each text, or each (text_1, text_2) pair, is one pooling request of a
*ForSequenceClassification model (embeddings.embed with CLASSIFY in its code), all of a call's
requests sharing steps; the worker returns the logits and the activation is applied here as
vLLM's pooler does (engine_common/request/classify.py).

A call is admitted or refused at once, as a Generate is: before its texts are tokenized it
takes its places under --max-requests-per-key (`call_window`: --max-num-seqs, its number of
inputs, and the places its key has left; RESOURCE_EXHAUSTED naming the bound when none is left),
holds them to its end, and keeps that many of its requests in flight, sending the next as one
finishes. So a call of 1024 pairs is served without filling the waiting queue other callers
share (--max-waiting) or passing its key's bound, another caller's request waits behind one
batch of it, not all of it, and nothing waits for a place of its key: before (session 45), a
call's requests waited for the key's places while the key's Generate and Embed calls were
refused at the bound, and a waiting call took every place as it came free, so the key's other
calls were refused for as long as it ran (docs/security.md, "Tenants"). Its requests' engine
ids are its own (`call_ids`). Each text or pair counts in the request counters as one Embed
(`RequestTally`).

A pair is tokenized as vLLM does (transformers' tokenizer(text_1, text_2), or text_1 + text_2
as one text for a model whose config.json says `use_pad_token: false`), all up front but held
compactly, within --max-score-tokens (engine_common/request/pair_prompts.py); for a model with
token types (BERT) the second text's start rides on the request's pooling code.
"""
from __future__ import annotations

import asyncio
import secrets
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from engine_common.request.classify import (IDENTITY, ClassifierInfo, activate, pair_code,
                                            score_pairs, uses_token_types)
from engine_common.request.pair_prompts import PairPrompts
from engine_common.request.params import ParamError
from engine_common.request.pooling import PoolerConfigError
from scheduler_service.api.api_keys import KeyPolicy
from scheduler_service.api.embeddings import check_pool_length, embed_in_place, prompt_of
from scheduler_service.api.front_door import FrontDoor
from scheduler_service.api.request_tally import RequestTally
from scheduler_service.errors import WrongRunner

# Texts (or pairs) one call may hold: each is a request in flight at once.
MAX_INPUTS = 1024


@dataclass(frozen=True)
class Classified:
    """One text's class: its label, probabilities (or logits) and prompt length."""

    label: str
    probs: list[float]
    num_tokens: int


def classifier_of(door: FrontDoor, call: str) -> ClassifierInfo:
    """The served classifier's labels and activations; WrongRunner unless the server runs one
    (Score: one with a single label)."""
    door.model.check_runner(call)
    try:
        info = ClassifierInfo.from_config(door.model.info.hf_config)
    except PoolerConfigError as e:
        raise WrongRunner(f"{call}: {e}") from None
    if call == "Score" and info.num_labels != 1:
        raise WrongRunner(f"Score: this model has num_labels={info.num_labels}; a score needs "
                          "a model with one label (use Classify)")
    return info


def _check_count(field: str, n: int) -> None:
    if not 1 <= n <= MAX_INPUTS:
        raise ParamError(field, f"{n} texts", f"1 to {MAX_INPUTS}")


def call_window(door: FrontDoor, caller: str, num_inputs: int = MAX_INPUTS) -> int:
    """Requests of one call of `num_inputs` in flight at once, the places it takes: a step's
    batch, within the places the caller's key has left (its bound less those its other
    requests hold; at least one, which `hold` refuses when none is left)."""
    per_key = door.quota.per_key
    left = None if per_key is None else per_key - door.quota.live(caller)
    bounds = (door.model.max_num_seqs, left, num_inputs, MAX_INPUTS)
    return max(1, min(b for b in bounds if b is not None))


def call_ids(kind: str, request_id: str) -> Callable[[int], str]:
    """The engine ids of a call's requests: `<kind>-<random>-<request_id>-<i>`, vLLM's
    per-endpoint prefix with a per-call random part (64 bits), so the same caller's Embed or
    Generate id (`<request_id>-<i>` included) never names one of them. The call answers with
    `request_id` as given."""
    base = f"{kind}-{secrets.token_hex(8)}-{request_id}"
    return lambda i: f"{base}-{i}"


async def classify(engine, door: FrontDoor, caller: str, request_id: str, texts: list[str],
                   activation: bool, tenant: KeyPolicy, pool_caller: str,
                   tally: RequestTally | None = None) -> list[Classified]:
    """Each text's class, in order (errors name `input[i]`; `tally`: the call's counts). The
    call's places are taken before its texts are tokenized (QueueFull at the key's bound)."""
    info = classifier_of(door, "Classify")
    _check_count("input", len(texts))
    window = call_window(door, caller, len(texts))
    with door.quota.hold(caller, request_id, window):
        return await _classify(engine, door, info, caller, request_id, texts, activation, tenant,
                               pool_caller, tally, window)


async def _classify(engine, door: FrontDoor, info: ClassifierInfo, caller: str,
                    request_id: str, texts: list[str], activation: bool, tenant: KeyPolicy,
                    pool_caller: str, tally: RequestTally | None, window: int) -> list[Classified]:
    ids, total, limit = [], 0, door.options.max_score_tokens
    for i, text in enumerate(texts):
        if not text:
            raise ParamError(f"input[{i}]", "an empty text", "a non-empty text")
        prompt = array("I", await prompt_of(door, (), text, pool_caller, (f"input[{i}]",) * 3))
        total += len(prompt)
        if total > limit:
            raise ParamError("input", f"{total} tokens in the first {i + 1} texts", f"at most "
                             f"{limit} tokens in one call's texts together (--max-score-tokens)")
        ids.append(prompt)       # 4 bytes a token until it is sent
    act = info.classify_activation if activation else IDENTITY
    code = door.model.pooler.code
    logits = await _run_all(engine, door, caller, call_ids("classify", request_id), len(ids),
                            lambda i: (ids[i].tolist(), code), tenant, tally, window)
    out = []
    for prompt, row in zip(ids, logits):
        probs = activate(row, act)
        best = max(range(len(probs)), key=probs.__getitem__)
        out.append(Classified(info.labels[best], probs, len(prompt)))
    return out


async def score(engine, door: FrontDoor, caller: str, request_id: str, text_1: list[str],
                text_2: list[str], activation: bool, tenant: KeyPolicy, pool_caller: str,
                tally: RequestTally | None = None) -> tuple[list[float], int]:
    """(each pair's score in order, the pairs' tokens together; `tally`: the call's counts).
    The call's places are taken before its pairs are tokenized (QueueFull at the key's
    bound)."""
    info = classifier_of(door, "Score")
    pairs = score_pairs(text_1, text_2)
    _check_count("text_2", len(pairs))
    window = call_window(door, caller, len(pairs))
    with door.quota.hold(caller, request_id, window):
        return await _score(engine, door, info, caller, request_id, pairs, activation, tenant,
                            pool_caller, tally, window)


async def _score(engine, door: FrontDoor, info: ClassifierInfo, caller: str, request_id: str,
                 pairs: list[tuple[str, str]], activation: bool, tenant: KeyPolicy,
                 pool_caller: str, tally: RequestTally | None,
                 window: int) -> tuple[list[float], int]:
    token_types = uses_token_types(door.model.info.hf_config)
    prompts = PairPrompts(door.model.tokenizer, door.model.info.hf_config,
                          door.options.max_score_tokens)
    codes = []
    for i, (a, b) in enumerate(pairs):
        if len(a) + len(b) > door.model.prompt_chars_fit:
            raise ParamError(f"pair[{i}]", f"{len(a) + len(b)} characters",
                             f"at most {door.model.prompt_chars_fit}")
        num_tokens = await door.offload(pool_caller, prompts.add, a, b)
        if not num_tokens:      # a decoder's pair template adds no tokens to two empty texts
            raise ParamError(f"pair[{i}]", "no tokens", "a pair of at least one token")
        check_pool_length(door.model, num_tokens, f"pair[{i}]")
        codes.append(pair_code(door.model.pooler.code, prompts.prompt(i)[1], token_types)
                     if token_types else door.model.pooler.code)

    act = info.score_activation if activation else IDENTITY
    logits = await _run_all(engine, door, caller, call_ids("score", request_id), len(prompts),
                            lambda i: (prompts.prompt(i)[0], codes[i]), tenant, tally, window)
    return [activate(row, act)[0] for row in logits], prompts.num_tokens


async def _run_all(engine, door: FrontDoor, caller: str, engine_id: Callable[[int], str],
                   num: int, prompt_at: Callable[[int], tuple[list[int], int]], tenant: KeyPolicy,
                   tally: RequestTally | None, window: int) -> list[list[float]]:
    """The logits of the call's `num` prompts (`prompt_at(i)`: ids and pooling code, built
    as each is sent), `window` of them (the places the call holds) in flight at once, in
    order; the first failure cancels (so aborts) the others."""
    if tally is not None:
        tally.choices(num)
    gate = asyncio.Semaphore(window)
    on_output = None if tally is None else tally.output

    async def one(i: int) -> list[float]:
        async with gate:          # FIFO: the call's requests start in their order
            ids, code = prompt_at(i)
            return await embed_in_place(engine, door, caller, engine_id(i), ids, tenant,
                                        on_output, pooling=code)

    tasks = [asyncio.ensure_future(one(i)) for i in range(num)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)     # each has aborted its own
        raise
