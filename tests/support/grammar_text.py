"""Grammar checks on a tiny real tokenizer: a GrammarCompiler over the byte-level BPE of
tests/support/tokenizers.py (320 ids; eos is "</s>", id 1), and whether a grammar accepts a text."""
from __future__ import annotations

from pathlib import Path

from engine_common.constraints.constraint import Constraint
from engine_common.text.tokenizer import Tokenizer
from tests.support.tokenizers import build_tiny_tokenizer_dir
from worker_service.sample.grammar import GrammarCompiler

EOS = 1


def tiny_compiler(tmp: Path, **kwargs) -> GrammarCompiler:
    model_dir = build_tiny_tokenizer_dir(tmp / "tok", bos_template=False)
    tok = Tokenizer.from_dir(model_dir)
    return GrammarCompiler(lambda: tok.backend.to_str(), tok.backend.get_vocab_size(), (EOS,),
                           **kwargs)


def encode(compiler: GrammarCompiler, text: str) -> list[int]:
    return compiler.tokenizer.tokenize_str(text)


def accepts(compiler: GrammarCompiler, constraint: Constraint, text: str) -> bool:
    """The whole text is consumed and the grammar may end there."""
    m = compiler.matcher(constraint)
    ids = encode(compiler, text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
