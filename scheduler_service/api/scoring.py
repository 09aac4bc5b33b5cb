"""Classification and cross-encoder scoring on the scheduler side (deltaserve.v1 Classify and
Score; docs/scoring.md): each text, or each (text_1, text_2) pair, is one pooling request of a
*ForSequenceClassification model (embeddings.embed with CLASSIFY in its code), all of a call's
requests sharing steps; the worker returns the logits and the activation is applied here as
vLLM's pooler does (engine_common/request/classify.py).

A call keeps at most one running batch of its requests in flight (`call_window`:
--max-num-seqs, and the caller's --max-requests-per-key) and sends the next as one finishes:
a call of 1024 pairs then never fills the waiting queue other callers share (--max-waiting),
nor passes its key's bound, and another caller's request waits behind one batch of it, not
all of it. Each text or pair counts in the request counters as one Embed (`RequestTally`).

A pair is tokenized as vLLM does (transformers' tokenizer(text_1, text_2), or text_1 + text_2
as one text for a model whose config.json says `use_pad_token: false`); for a model with
token types (BERT) the second text's start rides on the request's pooling code.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine_common.request.classify import (IDENTITY, ClassifierInfo, activate,
                                            encode_score_pair, pair_code, score_pairs,
                                            uses_token_types)
from engine_common.request.params import ParamError
from engine_common.request.pooling import PoolerConfigError
from scheduler_service.api.embeddings import check_pool_length, embed, prompt_of
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


def call_window(door: FrontDoor) -> int:
    """Requests of one call in flight at once: a step's batch, within the key's bound."""
    bounds = (door.model.max_num_seqs, door.quota.per_key, MAX_INPUTS)
    return max(1, min(b for b in bounds if b is not None))


async def classify(engine, door: FrontDoor, caller: str, request_id: str, texts: list[str],
                   activation: bool, salt: str, pool_caller: str,
                   tally: RequestTally | None = None) -> list[Classified]:
    """Each text's class, in order (errors name `input[i]`; `tally`: the call's counts)."""
    info = classifier_of(door, "Classify")
    _check_count("input", len(texts))
    ids = []
    for i, text in enumerate(texts):
        if not text:
            raise ParamError(f"input[{i}]", "an empty text", "a non-empty text")
        ids.append(await prompt_of(door, (), text, pool_caller, (f"input[{i}]",) * 3))
    act = info.classify_activation if activation else IDENTITY
    logits = await _run_all(engine, door, caller, request_id, ids,
                            [door.model.pooler.code] * len(ids), salt, tally)
    out = []
    for prompt, row in zip(ids, logits):
        probs = activate(row, act)
        best = max(range(len(probs)), key=probs.__getitem__)
        out.append(Classified(info.labels[best], probs, len(prompt)))
    return out


async def score(engine, door: FrontDoor, caller: str, request_id: str, text_1: list[str],
                text_2: list[str], activation: bool, salt: str, pool_caller: str,
                tally: RequestTally | None = None) -> tuple[list[float], int]:
    """(each pair's score in order, the pairs' tokens together; `tally`: the call's counts)."""
    info = classifier_of(door, "Score")
    pairs = score_pairs(text_1, text_2)
    _check_count("text_2", len(pairs))
    token_types = uses_token_types(door.model.info.hf_config)
    ids, codes = [], []
    for i, (a, b) in enumerate(pairs):
        if len(a) + len(b) > door.model.prompt_chars_fit:
            raise ParamError(f"pair[{i}]", f"{len(a) + len(b)} characters",
                             f"at most {door.model.prompt_chars_fit}")
        pair_ids, types = await door.offload(pool_caller, encode_score_pair,
                                             door.model.tokenizer, door.model.info.hf_config,
                                             a, b)
        if not pair_ids:        # a decoder's pair template adds no tokens to two empty texts
            raise ParamError(f"pair[{i}]", "no tokens", "a pair of at least one token")
        check_pool_length(door.model, len(pair_ids), f"pair[{i}]")
        ids.append(pair_ids)
        codes.append(pair_code(door.model.pooler.code, types, token_types))
    act = info.score_activation if activation else IDENTITY
    logits = await _run_all(engine, door, caller, request_id, ids, codes, salt, tally)
    return [activate(row, act)[0] for row in logits], sum(map(len, ids))


async def _run_all(engine, door: FrontDoor, caller: str, request_id: str,
                   prompts: list[list[int]], codes: list[int], salt: str,
                   tally: RequestTally | None) -> list[list[float]]:
    """Every prompt's logits (ids `<request_id>-<i>`), `call_window` of them in flight at
    once, in order; the first failure cancels (so aborts) the others."""
    if tally is not None:
        tally.choices(len(prompts))
    gate = asyncio.Semaphore(call_window(door))
    on_output = None if tally is None else tally.output

    async def one(i: int, ids: list[int], code: int) -> list[float]:
        async with gate:          # FIFO: the call's requests start in their order
            return await embed(engine, door, caller, f"{request_id}-{i}", ids, salt,
                               on_output, pooling=code)

    tasks = [asyncio.ensure_future(one(i, ids, code))
             for i, (ids, code) in enumerate(zip(prompts, codes))]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)     # each has aborted its own
        raise
