"""Sequence classification (cross-encoder) heads over our encoders and decoders, as transformers'
*ForSequenceClassification compute `logits` from the pooled row (sample/pooling.py pools it and
calls `classify`; the request's code carries CLASSIFY, engine_common/request/pooling.py):

    BertForSequenceClassification     classifier(tanh(pooler.dense(h[CLS])))
    (XLM)RobertaForSequenceClassification
                                      classifier.out_proj(tanh(classifier.dense(h[<s>])))
    Llama/Qwen2/Qwen3ForSequenceClassification
                                      score(h[last])          (no bias)

The heads are small ([num_labels, hidden], [hidden, hidden]) and replicated: every rank holds
the whole hidden state after the last all-reduce and computes the same logits. They hold and
compute in float32 whatever the model's dtype (the pooled row cast up), as vLLM's pooling
models' head_dtype: a bfloat16 head's logits are off by ~1e-2, enough to reorder close rerank
scores. config.json's `"head_dtype": "model"` keeps the model's dtype (vLLM's override), a
dtype name picks that one. None of these
models has an LM head (`pooling_only`): they serve --runner pooling only, and compute_logits
refuses. Dropout is inference's identity. The decoders' checkpoints carry no lm_head: the
loader ties one to the embedding (no copy), which nothing reads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_common.request.classify import HEAD_DTYPE_NAMES, check_head_dtype
from worker_service.models.bert import BertModel, RobertaModel
from worker_service.models.llama import (LlamaForCausalLM, Qwen2ForCausalLM,
                                         Qwen3ForCausalLM)
from worker_service.layers.sharding import default_weight_loader, new_param


# torch.float / torch.half are float32 / float16.
_HEAD_DTYPES = {name: getattr(torch, name) for name in HEAD_DTYPE_NAMES}


def head_dtype(hf_config: dict, model_dtype: torch.dtype) -> torch.dtype:
    """The classification head's dtype: config.json's `head_dtype` ("model": the model's; a
    dtype name), else float32 (vLLM's default for pooling models)."""
    name = hf_config.get("head_dtype")
    if name is None:
        return torch.float32
    if name == "model":
        return model_dtype
    check_head_dtype(hf_config)       # the scheduler refused a bad one at start already
    return _HEAD_DTYPES[name.lower()]


def num_labels(hf_config: dict) -> int:
    """config.json's num_labels (else len(id2label), else transformers' default 2)."""
    return int(hf_config.get("num_labels") or len(hf_config.get("id2label") or {}) or 2)


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b) with the whole W on every rank."""

    def __init__(self, in_size: int, out_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param((out_size, in_size), dtype, default_weight_loader)
        self.bias = new_param((out_size,), dtype, default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def _refuse_logits(model: nn.Module) -> None:
    raise ValueError(f"{type(model).__name__} is a classification model without an LM head: "
                     "it serves pooling requests only")


class BertForSequenceClassification(BertModel):
    """BERT with its pooler (dense + tanh over the [CLS] row) and a linear classifier."""

    pooling_only = True

    def __init__(self, hf_config: dict, tp, attn_backend, dtype: torch.dtype,
                 fused_ops: bool = False) -> None:
        super().__init__(hf_config, tp, attn_backend, dtype, fused_ops)
        h, head = self.args.hidden_size, head_dtype(hf_config, dtype)
        self.pooler = nn.Module()
        self.pooler.dense = ReplicatedLinear(h, h, True, head)
        self.classifier = ReplicatedLinear(h, num_labels(hf_config), True, head)

    def split_checkpoint_tensor(self, name: str, tensor) -> list[tuple[str, object]]:
        """BertModel's names; the pooler and the classifier kept."""
        short = name.removeprefix("bert.")
        if short.startswith(("pooler.", "classifier.")):
            return [(short, tensor)]
        return super().split_checkpoint_tensor(name, tensor)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_labels] of the pooled [CLS] row."""
        return self.classifier(torch.tanh(self.pooler.dense(pooled))).float()


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa / XLM-R with transformers' RobertaClassificationHead over the <s> row."""

    pooling_only = True

    def __init__(self, hf_config: dict, tp, attn_backend, dtype: torch.dtype,
                 fused_ops: bool = False) -> None:
        super().__init__(hf_config, tp, attn_backend, dtype, fused_ops)
        h, head = self.args.hidden_size, head_dtype(hf_config, dtype)
        self.classifier = nn.Module()
        self.classifier.dense = ReplicatedLinear(h, h, True, head)
        self.classifier.out_proj = ReplicatedLinear(h, num_labels(hf_config), True, head)

    def split_checkpoint_tensor(self, name: str, tensor) -> list[tuple[str, object]]:
        """RobertaModel's names; the classification head kept."""
        if name.startswith("classifier."):
            return [(name, tensor)]
        return super().split_checkpoint_tensor(name, tensor)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_labels] of the pooled <s> row."""
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(pooled))).float()


class DecoderClassifierMixin:
    """A decoder's `score` head (no bias) over the last prompt row, as transformers'
    *ForSequenceClassification (its last non-pad token: the last one, with no padding)."""

    pooling_only = True

    def __init__(self, hf_config: dict, tp, attn_backend, dtype: torch.dtype,
                 fused_ops: bool = False) -> None:
        super().__init__(hf_config, tp, attn_backend, dtype, fused_ops)
        self.score = ReplicatedLinear(self.args.hidden_size, num_labels(hf_config), False,
                                      head_dtype(hf_config, dtype))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_labels] of the pooled last row."""
        return self.score(pooled).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        _refuse_logits(self)


class LlamaForSequenceClassification(DecoderClassifierMixin, LlamaForCausalLM):
    """Llama with a score head."""


class Qwen2ForSequenceClassification(DecoderClassifierMixin, Qwen2ForCausalLM):
    """Qwen2 with a score head."""


class Qwen3ForSequenceClassification(DecoderClassifierMixin, Qwen3ForCausalLM):
    """Qwen3 with a score head (the Qwen3-Reranker family's seq-cls conversions)."""
