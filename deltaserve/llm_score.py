"""LLM.classify and LLM.score: vLLM's offline classification and cross-encoder scoring
(`LLM(model, runner="pooling").classify(prompts)` / `.score(text_1, text_2)`) for a
*ForSequenceClassification model (docs/scoring.md).

Each prompt (or pair) is a pooling request whose vector is the model's logits
(engine_common/request/pooling.py, CLASSIFY); the activation follows vLLM's rules
(engine_common/request/classify.py). A pair is tokenized as transformers' tokenizer(text_1,
text_2); its second text is token type 1 for a model with token types (BERT).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine_common.request.classify import (IDENTITY, ClassifierInfo, activate, pair_code,
                                            score_pairs, uses_token_types)
from engine_common.request.pair_prompts import PairPrompts
from engine_common.request.pooling import POOL_SAMPLING, POOL_STOPPING


@dataclass
class ClassificationOutput:
    """vLLM's ClassificationRequestOutput, flattened: the probabilities (the logits through
    the model's activation) and the raw logits."""

    request_id: str
    prompt_token_ids: list[int]
    probs: list[float]
    logits: list[float]

    @property
    def label_index(self) -> int:
        """The most probable class."""
        return max(range(len(self.probs)), key=self.probs.__getitem__)


@dataclass
class ScoringOutput:
    """vLLM's ScoringRequestOutput, flattened: one pair's score."""

    request_id: str
    prompt_token_ids: list[int]
    score: float


class ScoreMixin:
    """LLM's classify() and score(); the LLM sets `pooler`, `model_info` and `tokenizer`."""

    def classifier_info(self, call: str) -> ClassifierInfo:
        """The model's labels and activations; ValueError unless it is a classifier."""
        if self.pooler is None or not self.pooler.classify:
            raise ValueError(f"{call}() needs a sequence classification model (a "
                             "*ForSequenceClassification architecture) with runner='pooling'")
        return ClassifierInfo.from_config(self.model_info.hf_config)

    def classify(self, prompts, activation: bool = True) -> list[ClassificationOutput]:
        """Each prompt's class probabilities (prompts as generate()'s), in prompt order;
        `activation=False` (vLLM's use_activation) gives the raw logits as probs."""
        info = self.classifier_info("classify")
        act = info.classify_activation if activation else IDENTITY
        with self._exclusive("classify"):
            done = self._generate(prompts, POOL_SAMPLING, POOL_STOPPING, None, None,
                                  pooling=self.pooler.code)
        _raise_errors(done)
        return [ClassificationOutput(c.request_id, c.prompt_token_ids,
                                     activate(c.embedding, act), list(c.embedding))
                for c in done]

    def score(self, text_1: str | list[str], text_2: str | list[str],
              activation: bool = True) -> list[ScoringOutput]:
        """Cross-encoder scores, as vLLM's LLM.score: one text against one or N (1-to-N), or N
        against N (zipped); one score per pair, in order. The model must have one label. A
        1-to-N call tokenizes text_1 once; the pairs together hold at most 8 Mi tokens
        (pair_prompts.DEFAULT_MAX_SCORE_TOKENS; ParamError naming text_2 beyond)."""
        info = self.classifier_info("score")
        if info.num_labels != 1:
            raise ValueError(f"score() needs a model with num_labels=1 (a score per pair); "
                             f"this one has {info.num_labels}: use classify()")
        act = info.score_activation if activation else IDENTITY
        token_types = uses_token_types(self.model_info.hf_config)
        pairs = PairPrompts(self.tokenizer, self.model_info.hf_config)
        for a, b in score_pairs(text_1, text_2):
            pairs.add(a, b)
        prompts, codes = [], []
        for i in range(len(pairs)):
            ids, types = pairs.prompt(i)
            prompts.append(ids)
            codes.append(pair_code(self.pooler.code, types, token_types))
        with self._exclusive("score"):
            done = self._generate(prompts, POOL_SAMPLING, POOL_STOPPING, None, None,
                                  pooling=codes)
        _raise_errors(done)
        return [ScoringOutput(c.request_id, c.prompt_token_ids, activate(c.embedding, act)[0])
                for c in done]


def _raise_errors(done) -> None:
    for c in done:
        if c.error is not None:
            raise RuntimeError(c.error)
