"""The tiny test tokenizer: a real byte-level BPE trained on a fixed corpus (deterministic).

It is what `worker_service.models.tiny_model.make_tiny_model` ships beside its random weights; it needs
only the `tokenizers` library, so it lives on the torch-free side.
"""
from __future__ import annotations

import json
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 512

# Fixed training text: English prose, code-ish text and multi-byte characters (accents, CJK,
# emoji), so byte-level merges and multi-byte streaming detokenization both get exercised.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A serving engine schedules requests in "
    "steps; each step runs one forward pass over a batch of prompt and decode tokens.",
    "Paged attention keeps the key and value cache in fixed-size blocks. A block table maps "
    "every request's logical positions to physical blocks, so memory is never fragmented.",
    "When a request finishes, its blocks return to the free pool. Prefix caching lets two "
    "requests that share a system prompt reuse the same blocks without recomputing them.",
    "Tensor parallelism splits each weight matrix across devices: column-parallel layers "
    "split the outputs, row-parallel layers split the inputs and sum the partial results.",
    "Once upon a time there was a little model with sixty-four hidden units. It could not "
    "speak well, but it always answered quickly, and it never forgot a single token.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i * 2))\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 3.14159 -7 1e-4; symbols: {}[]()<>#@$%^&*=+",
    "héllo wörld, café, naïve, façade, jalapeño, Ångström, Zürich, São Paulo, crème brûlée.",
    "你好，世界。今天天气很好。我们一起学习语言模型。你好 你好 世界 世界",
    "こんにちは世界。ありがとう。Привет, мир! Γειά σου κόσμε. مرحبا بالعالم",
    "Emoji: 🙂 😀 🚀 🎉 👍 ❤️ 🙂🙂 — “quotes” ‘single’ … ellipsis, en–dash, em—dash.",
    "héllo wörld 你好 🙂 héllo wörld 你好 🙂",
)


def _train_tokenizer():
    """A byte-level BPE with TOKENIZER_VOCAB_SIZE entries, trained on CORPUS (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(CORPUS) * 3, trainer=trainer)
    return tokenizer


def make_tiny_tokenizer_dir(out_dir: str | Path) -> dict:
    """Write tokenizer.json + tokenizer_config.json (readable by transformers' AutoTokenizer)
    into out_dir. Returns {"vocab_size", "eos_token_id", "special_token_ids"} for a config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
              "pad_token": EOS_TOKEN, "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
              "model_max_length": 2048, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"vocab_size": tokenizer.get_vocab_size(),
            "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
            "special_token_ids": [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]}


