"""The engine tests' tiny tokenizer (built once per module)."""
from __future__ import annotations

import pytest

from engine_common.text.tokenizer import Tokenizer
from tests.support.tokenizers import build_tiny_tokenizer_dir


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(build_tiny_tokenizer_dir(tmp_path_factory.mktemp("tok")))
