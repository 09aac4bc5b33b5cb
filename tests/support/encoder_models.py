"""Tiny real encoder embedding models for tests: BertModel and XLMRobertaModel with random weights
(transformers' save_pretrained), each with a real fast tokenizer trained here with the
`tokenizers` library (BERT: WordPiece with [CLS] ... [SEP]; XLM-R: Unigram with <s> ... </s>),
and optionally the sentence-transformers files (modules.json, 1_Pooling/config.json) that
choose the pooling; plus the reference vector (transformers' last_hidden_state pooled as
sentence-transformers pools it: CLS the first row, MEAN the mean of every row, then Normalize).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "what is a KV cache? a store of keys and values for attention.",
    "Embeddings map a sentence to a vector; similar texts lie close together.",
    "naive cafe resume deja vu, the weather is nice and the sky is blue",
]
# max_position_embeddings: 64 BERT positions, 66 for XLM-R (positions start at pad id 1 + 1).
MAX_POSITIONS = 64


def _bert_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=special,
                                        show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizerFast", "do_lower_case": True, "cls_token": "[CLS]",
        "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]", "model_max_length": MAX_POSITIONS}))


def _xlmr_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    special = ["<s>", "<pad>", "</s>", "<unk>"]
    trainer = trainers.UnigramTrainer(vocab_size=150, special_tokens=special, unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "XLMRobertaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "sep_token": "</s>", "cls_token": "<s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": MAX_POSITIONS}))


def make_encoder_model(path: Path, arch: str = "bert", pooling: str | None = None,
                       normalize: bool = True, seed: int = 0, max_positions: int = MAX_POSITIONS,
                       masked_lm: bool = False, **overrides) -> Path:
    """A model directory of `arch` ("bert" or "xlmr") taking prompts of up to `max_positions`
    tokens; `pooling` ("CLS", "MEAN"): write the sentence-transformers files choosing it
    (Normalize listed when `normalize`); `masked_lm`: saved as the MaskedLM model (its
    checkpoint prefixed `bert.` / `roberta.`, with an LM head). `overrides`: config fields."""
    path.mkdir(parents=True, exist_ok=True)
    (_bert_tokenizer if arch == "bert" else _xlmr_tokenizer)(path)
    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    shape = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, initializer_range=0.3)
    shape.update(overrides)
    if arch == "bert":
        config = tf.BertConfig(max_position_embeddings=max_positions, pad_token_id=0, **shape)
        model_class = tf.BertForMaskedLM if masked_lm else tf.BertModel
    else:
        config = tf.XLMRobertaConfig(max_position_embeddings=max_positions + 2, pad_token_id=1,
                                     bos_token_id=0, eos_token_id=2, type_vocab_size=1, **shape)
        model_class = tf.XLMRobertaForMaskedLM if masked_lm else tf.XLMRobertaModel
    torch.manual_seed(seed)
    model_class(config).eval().save_pretrained(path)
    if pooling is not None:
        write_st_files(path, pooling, normalize, shape["hidden_size"])
    return path


def write_st_files(path: Path, pooling: str, normalize: bool, width: int = 64) -> None:
    """sentence-transformers' modules.json and 1_Pooling/config.json for CLS or MEAN."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": width, "pooling_mode_cls_token": pooling == "CLS",
        "pooling_mode_mean_tokens": pooling == "MEAN", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))


def reference_vectors(model_dir, prompts: list[list[int]], pooling: str,
                      normalize: bool) -> list[torch.Tensor]:
    """transformers' AutoModel (float32) over each prompt alone, pooled as sentence-transformers
    pools an unpadded sequence."""
    model = tf.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0]
        vec = h[0] if pooling == "CLS" else h.mean(0)
        out.append(torch.nn.functional.normalize(vec, dim=-1) if normalize else vec)
    return out


def reference_ids(model_dir, texts: list[str]) -> list[list[int]]:
    """The ids transformers' AutoTokenizer gives each text (special tokens added)."""
    tok = tf.AutoTokenizer.from_pretrained(model_dir)
    return [tok(t)["input_ids"] for t in texts]
