"""LLM.score / classify / embed hold at most two running batches of a call in the scheduler
(deltaserve/llm_requests.py pooling_window; before: every prompt up to max_waiting, 1024 by
default, each built and checked as a Request first), counted at every step of a real run, and
their results keep the call's order (each equal to the same prompt scored alone)."""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from deltaserve.llm_requests import POOLING_WINDOW_BATCHES
from scheduler_service.core.admission import RequestRejected
from tests.support.classifier_models import make_classifier_model
from tests.support.encoder_models import make_encoder_model

MAX_NUM_SEQS = 4
DOCS = [f"document {i}: " + "word " * (i % 7) for i in range(60)]


def _peak_in_scheduler(llm: LLM) -> list[int]:
    """Records, before each step, the requests in the LLM's scheduler (waiting + running)."""
    seen, step = [], llm.engine.step

    def counted_step():
        seen.append(len(llm.scheduler.waiting) + len(llm.scheduler.running))
        return step()
    llm.engine.step = counted_step
    return seen


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    model = str(make_classifier_model(tmp_path_factory.mktemp("bert") / "m", "bert", 1))
    llm = LLM(model, dtype="float32", max_num_seqs=MAX_NUM_SEQS, runner="pooling")
    yield llm
    llm.close()


def test_score_keeps_two_batches_in_the_scheduler_and_the_order(scorer):
    seen = _peak_in_scheduler(scorer)
    outs = scorer.score("what is a KV cache?", DOCS)
    assert len(seen) >= len(DOCS) // MAX_NUM_SEQS
    assert max(seen) == POOLING_WINDOW_BATCHES * MAX_NUM_SEQS < len(DOCS)
    alone = [scorer.score("what is a KV cache?", d)[0] for d in (DOCS[0], DOCS[29], DOCS[59])]
    for i, one in zip((0, 29, 59), alone):
        assert outs[i].prompt_token_ids == one.prompt_token_ids
        assert abs(outs[i].score - one.score) <= 1e-5
    assert len({o.request_id for o in outs}) == len(DOCS)
    assert scorer.scheduler.kv.pool.num_free_blocks == scorer.scheduler.num_total_blocks


def test_classify_keeps_the_window_and_order(scorer):
    seen = _peak_in_scheduler(scorer)
    prompts = [[5 + i % 11, 6, 7 + i % 5] for i in range(40)]
    outs = scorer.classify(prompts, activation=False)
    assert max(seen) == POOLING_WINDOW_BATCHES * MAX_NUM_SEQS
    assert [o.prompt_token_ids for o in outs] == prompts
    again = scorer.classify(prompts[::-1], activation=False)[::-1]
    torch.testing.assert_close(torch.tensor([o.logits for o in outs]),
                               torch.tensor([o.logits for o in again]), rtol=0, atol=1e-5)


def test_a_refused_prompt_late_in_the_call_fails_it_before_anything_runs(scorer):
    """Each prompt is still checked before the first is queued (named by its index), though
    the requests are made only as they are queued."""
    seen = _peak_in_scheduler(scorer)
    too_long = [5] * (scorer.scheduler.config.max_model_len + 1)
    with pytest.raises(RequestRejected, match=r"prompts\[37\]"):
        scorer.classify([[5, 6, 7]] * 37 + [too_long])
    assert seen == []


def test_embed_keeps_the_window(tmp_path):
    llm = LLM(str(make_encoder_model(tmp_path / "enc", "bert")), dtype="float32",
              max_num_seqs=MAX_NUM_SEQS, runner="pooling")
    try:
        seen = _peak_in_scheduler(llm)
        outs = llm.embed([[5 + i % 9, 6, 7] for i in range(20)])
    finally:
        llm.close()
    assert max(seen) == POOLING_WINDOW_BATCHES * MAX_NUM_SEQS
    torch.testing.assert_close(torch.tensor(outs[0].embedding), torch.tensor(outs[9].embedding),
                               rtol=0, atol=1e-5)            # the same prompt, nine apart
