"""engine_common/model_files/gguf_values.py through hf_config_from_gguf and the GGUF tokenizer: a
file whose metadata has the wrong type or an impossible value is refused with a GGUFError naming
the key and the value. Before: a string block_count or rms epsilon reached config.json and failed
later, or was served; a string softcap raised a bare ValueError; Phi-3's rope dims of 0 or over
the head became a partial_rotary_factor of 0 or 2.5; a string vocabulary made the tokenizers
library panic; malformed merges raised a bare TypeError; a string add_bos_token read as True.
llama.cpp's -1 token id reads as absent."""
from __future__ import annotations

import gguf
import pytest

from engine_common.model_files.gguf_config import generation_config_from_gguf
from engine_common.model_files.gguf_file import GGUFError
from tests.unit.engine_common.model_files.test_gguf_config import _minimal
from tests.unit.engine_common.model_files.test_gguf_families import F32, STR, U32, _config

I32 = gguf.GGUFValueType.INT32
WINDOW = {"attention__sliding_window": (4, U32)}

BAD = {
    "block-count-string": ("llama", {"block_count": ("2", STR)}, "llama.block_count='2'",
                           "an integer >= 1"),
    "heads-zero": ("llama", {"attention__head_count": (0, U32)},
                   "llama.attention.head_count=0", "an integer >= 1"),
    "rms-eps-string": ("llama", {"attention__layer_norm_rms_epsilon": ("x", STR)},
                       "llama.attention.layer_norm_rms_epsilon='x'", "a finite number > 0"),
    "rms-eps-negative": ("qwen2", {"attention__layer_norm_rms_epsilon": (-1.0, F32)},
                         "qwen2.attention.layer_norm_rms_epsilon=-1.0", "a finite number > 0"),
    "rope-base-string": ("llama", {"rope__freq_base": ("x", STR)}, "llama.rope.freq_base='x'",
                         "a finite number > 0"),
    "key-length-string": ("gemma2", {**WINDOW, "attention__key_length": ("8", STR)},
                          "gemma2.attention.key_length='8'", "an integer >= 2"),
    "softcap-string": ("gemma2", {**WINDOW, "attn_logit_softcapping": ("x", STR)},
                       "gemma2.attn_logit_softcapping='x'", "a finite number > 0"),
    "gemma2-window-string": ("gemma2", {"attention__sliding_window": ("4", STR)},
                             "gemma2.attention.sliding_window='4'", "an integer >= 1"),
    "gemma3-final-softcap-string": ("gemma3", {**WINDOW, "final_logit_softcapping": ("x", STR)},
                                    "gemma3.final_logit_softcapping='x'", "a finite number"),
    "phi3-rope-dims-zero": ("phi3", {"rope__dimension_count": (0, U32)},
                            "phi3.rope.dimension_count=0", "an integer >= 2"),
    "phi3-rope-dims-over-head": ("phi3", {"rope__dimension_count": (40, U32)},
                                 "phi3.rope.dimension_count=40", r"an even number of dims in \[2, "
                                 r"16\]"),
    "phi3-rope-dims-odd": ("phi3", {"rope__dimension_count": (7, U32)},
                           "phi3.rope.dimension_count=7", "an even"),
    "starcoder2-eps-string": ("starcoder2", {"attention__layer_norm_epsilon": ("x", STR)},
                              "starcoder2.attention.layer_norm_epsilon='x'",
                              "a finite number > 0"),
    "eos-id-string": ("llama", {}, "tokenizer.ggml.eos_token_id='1'", "an integer >= -1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_wrong_type_or_range_is_refused_naming_the_key(tmp_path, case):
    arch, keys, named, must = BAD[case]
    if case == "eos-id-string":       # a key outside the arch's namespace
        with pytest.raises(GGUFError, match=rf"metadata {named} is invalid: must be {must}"):
            generation_config_from_gguf(_minimal(
                tmp_path, extra={"tokenizer.ggml.eos_token_id": ("1", STR)}))
        return
    with pytest.raises(GGUFError, match=rf"metadata {named} is invalid: must be {must}"):
        _config(tmp_path, arch, **keys)


def test_llama_cpps_null_token_id_reads_as_absent(tmp_path):
    gen = generation_config_from_gguf(_minimal(
        tmp_path, extra={"tokenizer.ggml.padding_token_id": (-1, I32),
                         "tokenizer.ggml.eot_token_id": (-1, I32)}))
    assert gen == {"eos_token_id": 1}


def _tokenizer_file(tmp_path, tokens=("a", "b", "ab"), merges=("a b",), extra=()):
    """A byte-level ("gpt2") tokenizer file with `extra` (key, value, type) metadata; tokens or
    merges given as a str are written as one string instead of an array."""
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    for key, value in (("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.merges", merges)):
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    for key, value, kind in extra:
        w.add_key_value(key, value, kind)
    w.add_tensor("token_embd.weight", np.zeros((3, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path


ARRAY = gguf.GGUFValueType.ARRAY
BAD_TOKENIZERS = {
    # a str vocabulary made the tokenizers library panic (a BaseException past every handler)
    "tokens-a-string": ({"tokens": "abc"}, r"tokenizer.ggml.tokens \(a str\) is invalid: must "
                                           r"be a non-empty array of strings"),
    "merges-a-string": ({"merges": "a b"}, r"tokenizer.ggml.merges \(a str\) is invalid"),
    "merge-of-ints": ({"merges": (1, 2)}, r"tokenizer.ggml.merges\[0\]=1 is invalid: must be a "
                                          r"string"),
    "merge-without-space": ({"merges": ("ab",)}, r"tokenizer.ggml.merges\[0\]='ab' is invalid: "
                                                 r"must be two pieces joined by one space"),
    "token-type-strings": ({"extra": [("tokenizer.ggml.token_type", ["x", "y", "z"], ARRAY)]},
                           r"tokenizer.ggml.token_type\[0\]='x' is invalid: must be an integer"),
    "token-type-short": ({"extra": [("tokenizer.ggml.token_type", [1], ARRAY)]},
                         r"tokenizer.ggml.token_type \(an array of 1\) is invalid: must be a "
                         r"non-empty array of integers \(3: one per token\)"),
    "add-bos-a-string": ({"extra": [("tokenizer.ggml.add_bos_token", "no", STR)]},
                         r"tokenizer.ggml.add_bos_token='no' is invalid: must be a bool"),
    "template-a-number": ({"extra": [("tokenizer.chat_template", 5, U32)]},
                          r"tokenizer.chat_template=5 is invalid: must be a string"),
    "pre-a-number": ({"extra": [("tokenizer.ggml.pre", 5, U32)]},
                     r"tokenizer.ggml.pre=5 is invalid: must be a string"),
}


@pytest.mark.parametrize("case", list(BAD_TOKENIZERS))
def test_bad_tokenizer_metadata_is_refused_naming_the_key(tmp_path, case):
    from engine_common.model_files.model_dir import ModelDirError
    from engine_common.text.tokenizer import Tokenizer

    kwargs, message = BAD_TOKENIZERS[case]
    with pytest.raises(ModelDirError, match=message):
        Tokenizer.from_dir(_tokenizer_file(tmp_path, **kwargs))


def test_a_well_formed_tokenizer_file_still_reads(tmp_path):
    from engine_common.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(_tokenizer_file(tmp_path, extra=[
        ("tokenizer.ggml.token_type", [1, 1, 1], ARRAY),
        ("tokenizer.ggml.add_bos_token", False, gguf.GGUFValueType.BOOL)]))
    assert tok.encode("ab") == [2]


@pytest.mark.parametrize("value,kind", [("32", STR), (0, U32), (12, U32)])
def test_a_bad_alignment_is_refused_naming_it(tmp_path, value, kind):
    """Before: a string raised a bare ValueError and 0 a ZeroDivisionError."""
    with pytest.raises(GGUFError, match=rf"metadata general.alignment={value!r} is invalid: "
                                        r"must be a positive multiple of 8"):
        _minimal(tmp_path, extra={"general.alignment": (value, kind)})
