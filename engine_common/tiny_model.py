"""Tiny random Hugging Face model directories for tests and demos.

`make_tiny_model` writes a real model directory (config.json, safetensors weights via
transformers' own save_pretrained, generation_config.json) plus a real byte-level BPE tokenizer
trained on a fixed corpus, all deterministic in `seed`.

torch and transformers are imported inside the functions only: engine_common must stay
importable without torch (the scheduler imports it).

Why initializer_range = 0.3: with the transformers default (0.02) a random 64-wide model has
nearly flat logits, so greedy decoding repeats one token and top-2 margins are ~1e-5, which makes
"greedy tokens equal" tests flaky under float noise. At 0.3 the logits spread over several units:
greedy continuations vary from step to step and top-2 margins are typically 1e-2 .. 1.
"""
from __future__ import annotations

from pathlib import Path

ARCHS = ("qwen3", "llama", "qwen2")
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 512
INITIALIZER_RANGE = 0.3

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
    """Write tokenizer.json + tokenizer_config.json into out_dir.

    Returns {"vocab_size", "eos_token_id", "special_token_ids"} for building a config.
    """
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN,
                                      pad_token=EOS_TOKEN,
                                      additional_special_tokens=list(SPECIAL_TOKENS[1:]))
    wrapped.save_pretrained(out)
    return {"vocab_size": tokenizer.get_vocab_size(),
            "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
            "special_token_ids": [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]}


def _base_config(vocab_size: int, eos_token_id: int) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        initializer_range=INITIALIZER_RANGE, bos_token_id=eos_token_id,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id)


def _arch_config(arch: str):
    """(config class, model class, per-arch config defaults) for one of ARCHS."""
    import transformers as tf

    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    table = {
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"tie_word_embeddings": True}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM,
                  {"tie_word_embeddings": False, "rope_scaling": llama3_rope}),
    }
    return table[arch]


def _perturb_biases_and_norms(model) -> None:
    """transformers initialises biases to 0 and norm weights to 1, which would leave those
    code paths untested; give them random values (from the already seeded generator)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, INITIALIZER_RANGE)
            elif "norm" in name:
                param.normal_(1.0, 0.1)


def make_tiny_model(out_dir: str | Path, arch: str = "qwen3", seed: int = 0,
                    shard_size: int | str | None = None, **config_overrides) -> Path:
    """Write a tiny random `arch` model with its tokenizer into out_dir and return the path.

    shard_size (bytes or e.g. "100KB") makes save_pretrained split the weights and write
    model.safetensors.index.json. config_overrides replace any config field (e.g.
    num_key_value_heads=1, num_hidden_layers=3).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is invalid: must be one of {ARCHS}")
    import torch
    from transformers import GenerationConfig

    out = Path(out_dir)
    tok = make_tiny_tokenizer_dir(out)
    config_class, model_class, arch_defaults = _arch_config(arch)
    fields = {**_base_config(tok["vocab_size"], tok["eos_token_id"]), **arch_defaults,
              **config_overrides}
    config = config_class(**fields)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    _perturb_biases_and_norms(model)
    save_kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(out, **save_kwargs)
    GenerationConfig(eos_token_id=tok["eos_token_id"], bos_token_id=tok["eos_token_id"],
                     pad_token_id=tok["eos_token_id"], do_sample=False).save_pretrained(out)
    return out
