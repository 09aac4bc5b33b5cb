"""LLM.score tokenizes a 1-to-N call's text_1 once (counted on the real tokenizer's backend;
before: once per pair, each pair tokenized whole) and its scores still equal transformers' on
transformers' pair ids (BERT: token types; XLM-R: `</s></s>` between the texts).
"""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from tests.support.classifier_models import make_classifier_model, reference_logits, \
    reference_pairs
from tests.support.tokenizers import CountingBackend

QUERY = "what is a KV cache?"
DOCS = ["keys and values", "a fox", "the cache of keys", ""]


@pytest.mark.parametrize("arch", ["bert", "xlmr"])
def test_one_to_n_tokenizes_text_1_once(tmp_path, arch):
    model = str(make_classifier_model(tmp_path / arch, arch, 1))
    llm = LLM(model, dtype="float32", max_num_seqs=4, runner="pooling")
    try:
        llm.tokenizer.pair_template()              # its probe pairs are not the call's
        counting = CountingBackend(llm.tokenizer.backend)
        llm.tokenizer.backend = counting
        outs = llm.score(QUERY, DOCS)
    finally:
        llm.close()
    # Three pairs share the query's ids; the empty text_2 is the query alone (transformers).
    assert counting.texts.count(QUERY) == 2
    ids, types = reference_pairs(model, [(QUERY, d) for d in DOCS])
    assert [o.prompt_token_ids for o in outs] == ids
    want = [torch.sigmoid(r)[0].item() for r in reference_logits(
        model, ids, types if arch == "bert" else None)]
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), torch.tensor(want),
                               rtol=0, atol=1e-5)
