"""What `LLM.generate` accepts, checked before anything is queued: the prompt forms vLLM's
`LLM.generate` takes, one params object or a list of one per prompt, and what the model runner
would refuse in the step diff. Every refusal is a ParamError naming the field, the value and what
is allowed; a value that reached the runner instead failed a step, and with it the LLM.
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence

from engine_common.configuration.lora import adapter_name
from engine_common.constraints.constraint import Constraint
from engine_common.request.diff_limits import (MAX_CONSTRAINT_CHARS, MAX_STOP_TOKEN_IDS,
                                               MAX_TOP_LOGPROBS)
from engine_common.request.params import ID_SET_KNOBS, ParamError, SamplingParams, StoppingParams
from engine_common.text.chat_template import ChatMessage
from engine_common.text.tokenizer import Tokenizer

_PROMPT_FORMS = ("a string, a list of token ids, {'prompt': str}, {'prompt_token_ids': [ids]}, "
                 "or a list of those")


def prompt_ids(prompts, tokenizer: Tokenizer) -> list[list[int]]:
    """Each prompt's ids. As vLLM: one prompt (a string, a list of ids, a dict) is a batch of
    one, a list of them a batch (a lone string was iterated by character before)."""
    prompts = _as_list(prompts)
    if _is_one_prompt(prompts):
        prompts = [prompts]
    elif not isinstance(prompts, Sequence):
        raise ParamError("prompts", prompts, _PROMPT_FORMS)
    return [_one_prompt(f"prompts[{i}]", p, tokenizer) for i, p in enumerate(prompts)]


def _as_list(value):
    """A numpy array or torch tensor of ids as a list; anything else as it is."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes, Mapping, Sequence)):
        return value.tolist()
    return value


def _is_one_prompt(prompts) -> bool:
    if isinstance(prompts, (str, Mapping)):
        return True
    return (isinstance(prompts, Sequence) and len(prompts) > 0
            and _is_token_id(prompts[0]))


def _is_token_id(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


def _one_prompt(name: str, prompt, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unknown or len(prompt) != 1:
            raise ParamError(name, f"a dict with keys {sorted(prompt)}",
                             "{'prompt': str} or {'prompt_token_ids': [ids]} (nothing else is "
                             "supported)")
        (key, prompt), = prompt.items()
        name = f"{name}[{key!r}]"
        if (key == "prompt") != isinstance(prompt, str):
            raise ParamError(name, prompt, "a string" if key == "prompt" else "a list of ids")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    ids = _as_list(prompt)
    if isinstance(ids, (bytes, Mapping)) or not isinstance(ids, Sequence):
        raise ParamError(name, prompt, _PROMPT_FORMS)
    if ids and set(map(type, ids)) != {int}:      # in C; the loop only for other types
        for j, t in enumerate(ids):
            if not _is_token_id(t):
                raise ParamError(f"{name}[{j}]", t, "a token id (an integer)")
        ids = [operator.index(t) for t in ids]
    return list(ids)


def per_prompt(name: str, given, n: int, kind: type, default) -> list:
    """One `kind` per prompt from one (or None: `default`) or a list of exactly n."""
    allowed = (f"a {kind.__name__}, None, or a list of one per prompt ({n})")
    if isinstance(given, (list, tuple)):
        if len(given) != n:             # zip() dropped prompts, silently
            raise ParamError(name, f"a list of {len(given)}",
                             f"one for every prompt, or a list of one per prompt ({n})")
        for i, item in enumerate(given):
            if not (isinstance(item, kind) or item is None and kind is Constraint):
                raise ParamError(f"{name}[{i}]", item, allowed)
        return [default if item is None else item for item in given]
    if given is None:
        return [default] * n
    if not isinstance(given, kind):
        raise ParamError(name, given, allowed)
    return [given] * n


def check_constraints(constraints: list[Constraint | None]) -> None:
    """Each constraint's size, then the grammar engine's validation (ParamError). The runner
    bounds a step diff by constraints of MAX_CONSTRAINT_CHARS characters, the size the servers
    allow: bigger ones failed the step, and with it the LLM."""
    for i, c in enumerate(constraints):
        if c is None:
            continue
        if c.num_chars > MAX_CONSTRAINT_CHARS:
            together = " (its choices together)" if c.kind == "choice" else ""
            raise ParamError(f"constraint (prompt {i}).{c.kind}", f"{c.num_chars} characters",
                             f"at most {MAX_CONSTRAINT_CHARS} characters{together}")
        c.validate()


def check_for_runner(prompt_ids: list[list[int]], samplings: list[SamplingParams],
                     stoppings: list[StoppingParams], num_logprobs: int | None,
                     vocab_size: int, num_prompt_logprobs: int | None = None) -> None:
    """ParamError for what the runner would refuse in the step diff (diff_check.py), as the
    gRPC services refuse it at their edge: token ids outside [0, vocab_size) (prompts, stop ids,
    logit_bias, id sets), too many stop ids, num_logprobs or num_prompt_logprobs out of range
    or not an int. A refused
    diff failed the whole step, and the runner never took requests the scheduler still held:
    every later generate() failed too."""
    top = min(MAX_TOP_LOGPROBS, vocab_size)
    for name, k in (("num_logprobs", num_logprobs), ("num_prompt_logprobs", num_prompt_logprobs)):
        if k is not None and not (isinstance(k, int) and not isinstance(k, bool)
                                  and 0 <= k <= top):
            raise ParamError(name, k, f"None or an integer in [0, {top}]")
    for i, (ids, sp, st) in enumerate(zip(prompt_ids, samplings, stoppings)):
        if len(st.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParamError(f"stopping.stop_token_ids (prompt {i})",
                             f"{len(st.stop_token_ids)} ids", f"at most {MAX_STOP_TOKEN_IDS}")
        named = [(f"prompts[{i}]", ids), (f"stopping.stop_token_ids (prompt {i})",
                                          st.stop_token_ids),
                 (f"sampling.logit_bias (prompt {i})", [t for t, _ in sp.logit_bias])]
        named += [(f"sampling.{k.name} (prompt {i})", getattr(sp, k.name)) for k in ID_SET_KNOBS]
        for name, values in named:
            # max() and min() in C; the index only on a refusal
            if values and (max(values) >= vocab_size or min(values) < 0):
                j = next(j for j, t in enumerate(values) if not 0 <= t < vocab_size)
                raise ParamError(f"{name}[{j}]", values[j],
                                 f"a token id in [0, {vocab_size - 1}] (vocab_size)")


def conversations(messages) -> list[list]:
    """The conversations of LLM.chat: one (a list of messages) or several (a list of such
    lists). A message is a ChatMessage or a dict with a string `role`; OpenAI's content parts
    ([{"type": "text", "text": ...}]) become one string joined by newlines, as vLLM gives a
    template that expects a string (the template failed on the list with a TypeError)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ParamError("messages", messages, "a list of messages (dicts with 'role' and "
                         "'content'), or a list of such lists")
    several = bool(messages) and isinstance(messages[0], (list, tuple))
    convs = messages if several else [messages]
    return [[_message(f"messages[{i}][{j}]" if several else f"messages[{j}]", m)
             for j, m in enumerate(conv)] for i, conv in enumerate(convs)]


def _message(name: str, message):
    if isinstance(message, ChatMessage):
        return message
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ParamError(name, message, "a ChatMessage or a dict with a string 'role'")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    if not isinstance(content, Sequence):
        raise ParamError(f"{name}['content']", content, "a string or a list of text parts")
    texts = []
    for k, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise ParamError(f"{name}['content'][{k}]", part,
                             "a text part {'type': 'text', 'text': str} (only text is "
                             "supported)")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def capped_to_model(prompt_ids: list[list[int]], stoppings: list[StoppingParams],
                    max_model_len: int) -> list[StoppingParams]:
    """As vLLM's LLM: a max_tokens past what fits after its prompt in max_model_len stops there
    (finish_reason LENGTH) instead of refusing the whole call. A prompt with no room left, or a
    min_tokens past the room, is still refused (admission names it)."""
    out = []
    for ids, st in zip(prompt_ids, stoppings):
        room = max_model_len - len(ids)
        if st.max_tokens is not None and st.max_tokens > room >= max(st.min_tokens, 1):
            st = dataclasses.replace(st, max_tokens=room)
        out.append(st)
    return out


def lora_ids_per_prompt(given, n: int, registry) -> list[tuple[int, int]]:
    """generate()'s lora_request as one (adapter id, load generation) per prompt ((0, 0): the
    base model): one for all, or a list of exactly n; AdapterNotFound (a ParamError) for an
    adapter the LLM does not serve (now: scheduler_service/core/lora_registry.py)."""
    if isinstance(given, (list, tuple)):
        if len(given) != n:
            raise ParamError("lora_request", f"a list of {len(given)}",
                             f"one for every prompt, or a list of one per prompt ({n})")
        return [registry.resolve(adapter_name(g)) for g in given]
    return [registry.resolve(adapter_name(given))] * n
