"""What a sequence classification (cross-encoder) model's logits become, as vLLM's pooler says.

The worker returns a classifier's raw logits (engine_common/request/pooling.py, CLASSIFY); the
front door applies the activation here, per call:

- classify (vLLM's get_classification_act_fn): config.json's problem_type "regression" leaves
  the logits as they are, "multi_label_classification" takes the sigmoid of each; otherwise
  the sigmoid for one label, the softmax over two or more;
- score (vLLM's get_cross_encoder_act_fn): the sentence-transformers activation config.json
  names (`sentence_transformers.activation_fn`, else `sbert_ce_default_activation_function`):
  Identity leaves the logits, Sigmoid or Softmax take the classify rule above (vLLM's
  PoolerActivation.wraps); none named: the classify rule.

A request's `activation: false` (vLLM's use_activation) returns the raw logits. A pair is
tokenized as vLLM's get_score_prompt does (`encode_score_pair`). A score is one
number, so Score needs a one-label model (vLLM: "pooled_data should be a scalar score").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine_common.request.params import ParamError
from engine_common.request.pooling import PoolerConfigError, is_encoder, with_pair_start

IDENTITY, SIGMOID, SOFTMAX = "identity", "sigmoid", "softmax"
# config.json's head_dtype values (vLLM's): the model's own dtype, or one of these torch names
# (worker_service/models/classifiers.py maps them to dtypes).
HEAD_DTYPE_MODEL = "model"
HEAD_DTYPE_NAMES = ("float32", "float", "float16", "half", "bfloat16")
# sentence-transformers activation class names (torch.nn.modules.*) -> what vLLM does
_ST_ACTIVATIONS = {"Identity": IDENTITY, "Sigmoid": None, "Softmax": None}


@dataclass(frozen=True)
class ClassifierInfo:
    """A classifier's labels and the activations its calls apply."""

    num_labels: int
    labels: tuple[str, ...]        # index -> label (id2label, else LABEL_i)
    classify_activation: str
    score_activation: str

    @classmethod
    def from_config(cls, config: dict) -> "ClassifierInfo":
        """From config.json; PoolerConfigError naming a key we cannot honour (ParamError for
        a bad head_dtype)."""
        id2label = config.get("id2label") or {}
        num = config.get("num_labels", len(id2label) or 2)   # transformers' default: 2
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise PoolerConfigError(f"config.json: num_labels={num!r}: expected an integer >= 1")
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")))
                       for i in range(num))
        by_count = SIGMOID if num < 2 else SOFTMAX
        problem = config.get("problem_type")
        classify = {"regression": IDENTITY, "multi_label_classification": SIGMOID}.get(
            problem, by_count)
        check_head_dtype(config)
        return cls(num, labels, classify, _score_activation(config, by_count))


def check_head_dtype(config: dict) -> None:
    """ParamError naming config.json's `head_dtype` unless it is unset, "model" or a dtype
    name (checked at start, where the worker would only fail building the model)."""
    name = config.get("head_dtype")
    if name is None or name == HEAD_DTYPE_MODEL:
        return
    if not isinstance(name, str) or name.lower() not in HEAD_DTYPE_NAMES:
        raise ParamError("config.json head_dtype", name, f'"{HEAD_DTYPE_MODEL}" (the model\'s '
                         f"dtype) or one of {', '.join(HEAD_DTYPE_NAMES)}")


def _score_activation(config: dict, by_count: str) -> str:
    st = config.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or config.get("sbert_ce_default_activation_function")
    if name is None:
        return by_count
    short = str(name).rsplit(".", 1)[-1]
    if not str(name).startswith("torch.nn.modules.") or short not in _ST_ACTIVATIONS:
        raise PoolerConfigError(f"config.json: activation function {name!r} is not supported: "
                                f"expected torch.nn.modules.<{'|'.join(_ST_ACTIVATIONS)}>")
    return _ST_ACTIVATIONS[short] or by_count


def activate(logits: list[float], activation: str) -> list[float]:
    """`logits` through `activation` (IDENTITY, SIGMOID or SOFTMAX), in float64 math."""
    if activation == SIGMOID:
        return [_sigmoid(x) for x in logits]
    if activation == SOFTMAX:
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return [e / total for e in exps]
    return list(logits)


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def uses_token_types(hf_config: dict) -> bool:
    """The model embeds token types (BERT: type_vocab_size 2), so a pair's second text is sent
    as type 1; RoBERTa / XLM-R (1 type) and decoders see only the ids."""
    return is_encoder(hf_config) and int(hf_config.get("type_vocab_size", 2)) > 1


def concatenates_pairs(hf_config: dict) -> bool:
    """config.json's `use_pad_token: false` (vLLM's "LLM as reranker" conversions, e.g. its
    convert_model_to_seq_cls.py): a pair is text_1 + text_2 tokenized as one text, as vLLM's
    get_score_prompt does, not with the tokenizer's pair template (unset: the template)."""
    return hf_config.get("use_pad_token", True) is False


def encode_score_pair(tokenizer, hf_config: dict, text_1: str, text_2: str
                      ) -> tuple[list[int], list[int]]:
    """(ids, token type ids) of a score pair as vLLM tokenizes it: tokenizer(text_1, text_2),
    or tokenizer(text_1 + text_2) (all type 0) when the model `concatenates_pairs`."""
    if concatenates_pairs(hf_config):
        ids = tokenizer.encode(text_1 + text_2)
        return ids, [0] * len(ids)
    return tokenizer.encode_pair(text_1, text_2)


def pair_code(code: int, type_ids: list[int], token_types: bool) -> int:
    """A pair request's pooling code: `code` with the first type-1 position when the model
    uses token types (`type_ids` must then be 0...0 1...1, as a pair template makes them)."""
    if not token_types or 1 not in type_ids:
        return code
    start = type_ids.index(1)
    if any(t != 1 for t in type_ids[start:]) or any(t != 0 for t in type_ids[:start]):
        raise ParamError("token_type_ids", type_ids[:64], "0...0 1...1 (the tokenizer's pair "
                         "template gives other types)")
    return with_pair_start(code, start)


def score_pairs(text_1, text_2, names: tuple[str, str] = ("text_1", "text_2")
                ) -> list[tuple[str, str]]:
    """vLLM's score inputs as pairs: one text and one (1 pair), one and N (1-to-N), N and N
    (N-to-N, zipped). ParamError naming the field otherwise."""
    one, many = ([text_1] if isinstance(text_1, str) else list(text_1),
                 [text_2] if isinstance(text_2, str) else list(text_2))
    for name, texts in zip(names, (one, many)):
        if not texts:
            raise ParamError(name, "no text", "at least one text")
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise ParamError(name, repr(bad)[:80], "a text or a list of texts")
    if len(one) == 1:
        return [(one[0], t) for t in many]
    if len(one) != len(many):
        raise ParamError(names[1], f"{len(many)} texts", f"1 or {len(one)} (one per "
                         f"{names[0]}: {len(one)} texts)")
    return list(zip(one, many))
