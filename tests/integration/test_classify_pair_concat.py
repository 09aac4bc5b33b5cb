"""A decoder reranker converted as vLLM's convert_model_to_seq_cls.py does carries
`use_pad_token: false` in config.json: vLLM then scores a pair as text_1 + text_2 tokenized as
one text (get_score_prompt), not with the tokenizer's pair template. LLM.score (and the Score
RPC, through the same engine_common.request.classify.encode_score_pair) tokenizes it so and
equals transformers on those ids; before, the pair template split the texts' tokens at the
seam (and a real Llama template adds a second BOS).
"""
from __future__ import annotations

import torch
import transformers as tf

from deltaserve.llm import LLM
from tests.support.classifier_models import make_classifier_model, reference_logits

PAIRS = [("what is a KV ca", "che?"), ("the quick bro", "wn fox")]


def test_use_pad_token_false_scores_the_concatenated_text(tmp_path):
    model = str(make_classifier_model(tmp_path / "qwen3", "qwen3", 1, use_pad_token=False))
    tok = tf.AutoTokenizer.from_pretrained(model)
    joined = [tok(a + b)["input_ids"] for a, b in PAIRS]
    assert joined != [tok(a, b)["input_ids"] for a, b in PAIRS]     # the test can tell
    llm = LLM(model, dtype="float32", max_num_seqs=4, runner="pooling")
    try:
        outs = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])
    finally:
        llm.close()
    assert [o.prompt_token_ids for o in outs] == joined
    want = [torch.sigmoid(r)[0].item() for r in reference_logits(model, joined)]
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), torch.tensor(want),
                               rtol=0, atol=1e-5)
