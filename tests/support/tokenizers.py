"""A tiny real byte-level BPE tokenizer directory for tokenizer and output-processing tests."""
import json
from pathlib import Path
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers


CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "你好世界，今天天气很好。🙂🦊",
    "naïve café résumé — déjà vu",
    "Привет, мир! Ελληνικά κείμενα.",
]


def build_tiny_tokenizer_dir(path: Path, add_bos_token: bool | None = None,
                             bos_template: bool = True, add_eos_token: bool | None = None) -> Path:
    """Train a ~300-token byte-level BPE on CORPUS and save tokenizer files under `path`."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 0)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>"}
    for key, value in (("add_bos_token", add_bos_token), ("add_eos_token", add_eos_token)):
        if value is not None:
            config[key] = value
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _byte_token_ids(tok, data: bytes) -> list[int]:
    """Ids of the single-byte tokens spelling `data` (byte-level alphabet, GPT-2 mapping)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [tok.token_to_id(table[b]) for b in data]


class CountingBackend:
    """The real tokenizers.Tokenizer, counting each text it tokenizes (a pair's two)."""

    def __init__(self, backend):
        self._backend = backend
        self.texts: list[str] = []

    def encode_batch(self, inputs, **kwargs):
        for item in inputs:
            self.texts.extend(item if isinstance(item, tuple) else [item])
        return self._backend.encode_batch(inputs, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)
