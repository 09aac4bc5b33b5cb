"""Embeddings on the scheduler side: which pooling a `--runner pooling` server applies, and one
embedding request through the engine (the vLLM engine protocol's Embed calls `embed`).

A pooling request is an engine Request with `pooling` set: it computes its prompt (chunked,
with prefix-cache hits for a decoder's LAST pooling; an encoder's in one step), samples
nothing, and finishes with its vector (docs/embeddings.md).
"""
from __future__ import annotations

from contextlib import aclosing

from engine_common.request.classify import ClassifierInfo
from engine_common.request.params import ParamError
from engine_common.request.pooling import (POOL_SAMPLING, POOL_STOPPING, PoolerConfig,
                                           PoolerConfigError, check_runner,
                                           model_pooler_config,
                                           parse_pooler_config, read_config)
from scheduler_service.api.api_keys import KeyPolicy
from scheduler_service.api.front_door import FrontDoor, ServedModel, check_vocab
from scheduler_service.api.guard import scoped_id
from scheduler_service.core.request import Request
from scheduler_service.errors import RequestFailed


def served_pooler(runner: str, pooler_config: str | None, model_dir: str
                  ) -> PoolerConfig | None:
    """The server's pooling for --runner pooling (the model directory's, under
    --pooler-config); None for --runner generate (where --pooler-config is refused, and so is
    an encoder model: it has no LM head)."""
    try:
        check_runner(runner, model_dir)
    except PoolerConfigError as e:
        raise ParamError("--runner", runner, f"pooling for this model ({e})") from None
    if runner != "pooling":
        if pooler_config:
            raise ParamError("--pooler-config", pooler_config, "only with --runner pooling")
        return None
    try:
        pooler = parse_pooler_config(pooler_config, model_pooler_config(model_dir))
        if pooler.classify:       # its labels and activations must be ones we honour
            ClassifierInfo.from_config(read_config(model_dir))
        return pooler
    except PoolerConfigError as e:
        raise ParamError("--pooler-config", pooler_config or "unset",
                         f"a pooling this engine runs ({e})") from None


# The prompt fields' names in the vLLM engine protocol's EmbedRequest: (the prompt, its ids,
# its text); deltaserve.v1's are ("prompt", "token_ids", "text").
VLLM_FIELDS = ("tokenized", "tokenized.input_ids", "tokenized.original_text")


async def prompt_of(door: FrontDoor, input_ids, text: str, caller: str,
                    names: tuple[str, str, str] = VLLM_FIELDS) -> list[int]:
    """The ids to embed: `input_ids` (checked against the vocabulary), else `text` tokenized
    on the pool; at least one, at most max_model_len (nothing is sampled after them), and for
    an encoder at most the step's token budget (its prompt is never chunked). Errors name the
    fields by `names`."""
    info = door.model.info
    prompt, ids_field, text_field = names
    if len(input_ids) > info.max_model_len:       # before copying millions of ids
        check_pool_length(door.model, len(input_ids), prompt)
    if len(input_ids):
        ids = list(input_ids)
        check_vocab(ids_field, ids, info.vocab_size)
    elif text:
        if len(text) > door.model.prompt_chars_fit:
            raise ParamError(text_field, f"{len(text)} characters",
                             f"at most {door.model.prompt_chars_fit}")
        ids = await door.offload(caller, door.model.tokenizer.encode, text)
    else:
        raise ParamError(prompt, f"no {ids_field} and no {text_field}",
                         "at least one token id, or a text")
    if not ids:
        raise ParamError(text_field, repr(text), "a text of at least one token")
    check_pool_length(door.model, len(ids), prompt)
    return ids


def check_pool_length(model: ServedModel, num_tokens: int, field: str) -> None:
    """ParamError naming `field` unless a pooling prompt of `num_tokens` fits max_model_len
    and, for an encoder (whole-prompt pooling), the step's token budget."""
    limit = model.info.max_model_len
    if num_tokens > limit:
        raise ParamError(field, f"{num_tokens} tokens", f"at most {limit} tokens "
                         f"(max_model_len {limit})")
    budget = model.max_step_tokens
    if model.pooler.whole_prompt and budget is not None and num_tokens > budget:
        raise ParamError(field, f"{num_tokens} tokens", f"at most {budget} tokens "
                         f"(max_num_batched_tokens {budget}: an encoder model computes a "
                         "prompt in one step)")


async def embed_in_place(engine, door: FrontDoor, caller: str, request_id: str,
                         prompt_ids: list[int], tenant: KeyPolicy, on_output=None,
                         pooling: int | None = None) -> list[float]:
    """The vector of one prompt, pooled as the server's pooler says (or as `pooling`, a code
    of it with a pair start: scoring.py): `caller`'s request `request_id` under its own id
    namespace (`on_output`: called with the request's output, for the request counters). The
    caller holds the request's place (an Embed call takes it before tokenizing, a Classify or
    Score call its window's), so a key at its bound is refused before it costs tokenizer
    time. A cancelled caller aborts it. A classifier's vector is its logits. `tenant`: the
    caller's key's policy (its cache salt, and its default priority: no API runs a key
    outside its priority= range)."""
    model = door.model
    request = Request(scoped_id(caller, request_id), prompt_ids, POOL_SAMPLING, POOL_STOPPING,
                      model.info.eos_token_ids, num_logprobs=None, cache_salt=tenant.salt,
                      priority=tenant.default_priority,
                      pooling=model.pooler.code if pooling is None else pooling)
    last = None
    async with aclosing(engine.generate(request)) as outputs:
        async for out in outputs:
            last = out
            if on_output is not None:
                on_output(out)
    if last is not None and last.error is not None:
        raise last.error
    if last is None or last.embedding is None:
        raise RequestFailed(f"embedding request {request_id!r} ended without a vector "
                            f"({'no output' if last is None else last.finish_reason!r})")
    return last.embedding
