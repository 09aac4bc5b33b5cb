"""n-gram drafts under async scheduling on a sequence that repeats one token (a forced token,
greedy): every n-gram lookup hits, so the drafts must land, as they do in sync scheduling."""
from __future__ import annotations

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.integration.test_spec_decode import SPEC

FORCED = 200


def _run(model: str, spec: bool, asynchronous: bool):
    llm = LLM(model, dtype="float32", num_kv_blocks=128, async_scheduling=asynchronous,
              speculative_config=SPEC if spec else None)
    out = llm.generate([[FORCED] * 7], SamplingParams(logit_bias=((FORCED, 100.0),)),
                       StoppingParams(max_tokens=24, ignore_eos=True))
    return out[0].token_ids, (llm.scheduler.spec.stats if spec else None)


def test_async_drafts_land_on_a_repeated_token(tiny_models):
    """The proposer follows the suffix n-gram's last earlier occurrence; on [200] * n only one
    token follows it, and async scheduling (SpecDecoder._propose) asks for k + 1, spending the
    first on its guess of the step in flight's last token. propose_ngram continues a
    continuation that runs into the sequence end periodically, so it gets k + 1 and drafts."""
    model = tiny_models("qwen3")
    off, _ = _run(model, False, False)
    assert off == [FORCED] * 24                   # the workload is what it says
    sync, sync_stats = _run(model, True, False)
    got, stats = _run(model, True, True)
    assert sync == got == off
    assert sync_stats.num_accepted_tokens > 0, sync_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
