"""config.json's max_position_embeddings: an integer, or ModelDirError naming it.

null, a list or a string made int() raise TypeError/ValueError from ModelInfo.from_dir: an Init
then failed INTERNAL (not INVALID_ARGUMENT) and `deltaserve serve` (which names ModelDirError)
printed a traceback. Absent means the architecture's transformers default (test_max_len.py):
LlamaConfig's 2048 here."""
from __future__ import annotations

import json

import pytest

from engine_common.model_files.model_dir import ModelDirError, ModelInfo


def _model_dir(tmp_path, **fields):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("value", [None, "abc", "4096", [4096], {"a": 1}, 4096.5, True])
def test_a_max_position_embeddings_that_is_not_an_integer_is_refused_by_name(tmp_path, value):
    with pytest.raises(ModelDirError, match=r"max_position_embeddings=.* must be an integer"):
        ModelInfo.from_dir(_model_dir(tmp_path, max_position_embeddings=value))


def test_integers_and_absent_are_read(tmp_path):
    assert ModelInfo.from_dir(_model_dir(tmp_path, max_position_embeddings=4096)).max_model_len \
        == 4096
    assert ModelInfo.from_dir(_model_dir(tmp_path, max_position_embeddings=8192.0),
                              max_model_len=100).max_model_len == 100
    assert ModelInfo.from_dir(_model_dir(tmp_path)).max_model_len == 2048
