"""A sentence pair's special tokens (engine_common/text/pair_template.py) and Tokenizer.encode_pair
agree with transformers' tokenizer(text_1, text_2):

  - a tokenizer whose tokenizer_config.json sets add_bos_token / add_eos_token: transformers 5
    drops both flags when tokenizer.json is there (tokenization_utils_base, _from_pretrained),
    so a pair is tokenizer.json's pair template, not the flags' BOS/EOS that `encode` applies;
  - BERT's and XLM-R's pair templates, read off their post-processors.
"""
from __future__ import annotations

import pytest
import transformers as tf

from engine_common.text.tokenizer import Tokenizer
from tests.support import encoder_models as enc
from tests.support.tokenizers import build_tiny_tokenizer_dir

# The last: transformers takes an empty text_pair for none (text_1 alone, its single template);
# before, encode_pair gave the pair template around an empty second text.
PAIRS = [("Hello world", "how are you today?"), ("你好世界", "naïve café"), ("a", "")]


def _transformers_pairs(path) -> list[tuple[list[int], list[int]]]:
    tok = tf.AutoTokenizer.from_pretrained(str(path))
    out = []
    for a, b in PAIRS:
        e = tok(a, b, return_token_type_ids=True)
        out.append((e["input_ids"], e["token_type_ids"]))
    return out


@pytest.mark.parametrize("add_bos, add_eos", [(True, True), (True, False), (False, True),
                                              (False, False)])
def test_pairs_of_a_tokenizer_with_bos_eos_flags_are_as_transformers(tmp_path, add_bos, add_eos):
    path = build_tiny_tokenizer_dir(tmp_path / "tok", add_bos_token=add_bos,
                                    add_eos_token=add_eos)
    ours = Tokenizer.from_dir(path)
    assert [ours.encode_pair(a, b) for a, b in PAIRS] == _transformers_pairs(path)


@pytest.mark.parametrize("make", [enc._bert_tokenizer, enc._xlmr_tokenizer])
def test_encoder_pair_templates_are_read_off_the_post_processor(tmp_path, make):
    make(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    template = ours.pair_template()
    assert template is not None and template.num_added in (3, 4)   # BERT 3, RoBERTa 4
    for a, b in PAIRS[:2]:
        enc_pair = ours.backend.encode(a, b)
        assert ours.encode_pair(a, b) == (enc_pair.ids, enc_pair.type_ids)
    assert [ours.encode_pair(a, b) for a, b in PAIRS] == _transformers_pairs(tmp_path)


def test_a_template_without_a_pair_form(tmp_path):
    # The tiny BPE's TemplateProcessing names only `single` ("<s> $A"): its pairs are then
    # "$A $B:1"; read off as an empty template, they equal the backend's own pair encoding.
    ours = Tokenizer.from_dir(build_tiny_tokenizer_dir(tmp_path / "tok"))
    for a, b in PAIRS[:2]:
        enc_pair = ours.backend.encode(a, b)
        assert ours.encode_pair(a, b) == (enc_pair.ids, enc_pair.type_ids)
