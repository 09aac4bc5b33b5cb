"""LLM.embed: vLLM's offline embeddings (`LLM(model, runner="pooling").embed(prompts)`).

A pooling request computes its prompt and pools the final hidden states into one vector
(engine_common/request/pooling.py, docs/embeddings.md); it samples no token.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine_common.request.classify import ClassifierInfo
from engine_common.request.pooling import (POOL_SAMPLING, POOL_STOPPING, PoolerConfig,
                                           check_runner, model_pooler_config,
                                           parse_pooler_config, read_config)

RUNNERS = ("generate", "pooling")


@dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingRequestOutput, flattened: the prompt's ids and its vector."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


def pooler_from_kwargs(model_dir: str, kwargs: dict) -> PoolerConfig | None:
    """Take `runner` and `pooler_config` (a dict or its JSON) out of the LLM's keyword
    arguments: the pooling configuration for runner="pooling", None for generation."""
    runner = kwargs.pop("runner", "generate")
    given = kwargs.pop("pooler_config", None)
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r}: expected one of {list(RUNNERS)}")
    check_runner(runner, model_dir)
    if runner == "generate":
        if given is not None:
            raise ValueError("pooler_config is for runner='pooling'")
        return None
    if isinstance(given, dict):
        given = json.dumps(given)
    pooler = parse_pooler_config(given, model_pooler_config(model_dir))
    if pooler.classify:       # its labels and activations must be ones we honour
        ClassifierInfo.from_config(read_config(model_dir))
    return pooler


class EmbedMixin:
    """LLM's embed(); the LLM sets `pooler` (None: a generation LLM)."""

    pooler: PoolerConfig | None = None

    def embed(self, prompts) -> list[EmbeddingOutput]:
        """One vector per prompt (a string, token ids, or a list of them; as generate()), in
        prompt order, pooled as the model's pooler configuration says (LAST and normalised by
        default)."""
        if self.pooler is None:
            raise ValueError("embed() needs an LLM built with runner='pooling' (vLLM's "
                             "--runner pooling); this one generates")
        with self._exclusive("embed"):
            done = self._generate(prompts, POOL_SAMPLING, POOL_STOPPING, None, None,
                                  pooling=self.pooler.code)
        for c in done:
            if c.error is not None:
                raise RuntimeError(c.error)
        return [EmbeddingOutput(c.request_id, c.prompt_token_ids, c.embedding) for c in done]

    def _check_generates(self) -> None:
        if self.pooler is not None:
            raise ValueError("this LLM was built with runner='pooling': it embeds (embed()), "
                             "it does not generate")
