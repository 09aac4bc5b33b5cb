"""Tiny real sequence classification (cross-encoder) models for tests, with random weights saved
by transformers: BertForSequenceClassification and XLMRobertaForSequenceClassification over
the tiny encoders' tokenizers (tests/support/encoder_models.py), and Qwen3 / Qwen2 / Llama
ForSequenceClassification over the tiny byte-level tokenizer; plus the reference: transformers'
AutoModelForSequenceClassification logits (float32) of each prompt alone.
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf
from tokenizers import Tokenizer

from engine_common.text.tiny_tokenizer import make_tiny_tokenizer_dir
from tests.support import encoder_models as enc

_DECODERS = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForSequenceClassification),
             "qwen2": (tf.Qwen2Config, tf.Qwen2ForSequenceClassification),
             "llama": (tf.LlamaConfig, tf.LlamaForSequenceClassification)}


def make_classifier_model(path: Path, arch: str = "bert", num_labels: int = 3, seed: int = 0,
                          **overrides) -> Path:
    """A model directory of `arch` ("bert", "xlmr", or a decoder of _DECODERS) with a
    `num_labels` head; `overrides`: config fields (problem_type, id2label, ...)."""
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    labels = {"id2label": {i: f"class-{i}" for i in range(num_labels)},
              "label2id": {f"class-{i}": i for i in range(num_labels)}}
    if arch in _DECODERS:
        tok = make_tiny_tokenizer_dir(path)
        config_class, model_class = _DECODERS[arch]
        config = config_class(vocab_size=tok["vocab_size"], hidden_size=64,
                              intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=256, initializer_range=0.3,
                              pad_token_id=tok["eos_token_id"], eos_token_id=tok["eos_token_id"],
                              tie_word_embeddings=False, **labels, **overrides)
    else:
        (enc._bert_tokenizer if arch == "bert" else enc._xlmr_tokenizer)(path)
        vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
        shape = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=128, initializer_range=0.3,
                     **labels, **overrides)
        if arch == "bert":
            config = tf.BertConfig(max_position_embeddings=enc.MAX_POSITIONS, pad_token_id=0,
                                   **shape)
            model_class = tf.BertForSequenceClassification
        else:
            config = tf.XLMRobertaConfig(max_position_embeddings=enc.MAX_POSITIONS + 2,
                                         pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                         type_vocab_size=1, **shape)
            model_class = tf.XLMRobertaForSequenceClassification
    model = model_class(config).eval()
    with torch.no_grad():          # transformers zeroes biases: make the heads' count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


def reference_logits(model_dir, prompts: list[list[int]],
                     type_ids: list[list[int]] | None = None) -> list[torch.Tensor]:
    """transformers' logits (float32) of each prompt alone (with its token types if given)."""
    model = tf.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    out = []
    for i, ids in enumerate(prompts):
        extra = {} if type_ids is None else {"token_type_ids": torch.tensor([type_ids[i]])}
        with torch.no_grad():
            out.append(model(torch.tensor([ids]), **extra).logits[0])
    return out


def reference_pairs(model_dir, pairs: list[tuple[str, str]]) -> tuple[list, list]:
    """(ids, token type ids) of each pair, as transformers' tokenizer(text_1, text_2)."""
    tok = tf.AutoTokenizer.from_pretrained(model_dir)
    encoded = [tok(a, b) for a, b in pairs]
    return ([e["input_ids"] for e in encoded],
            [e.get("token_type_ids", [0] * len(e["input_ids"])) for e in encoded])
