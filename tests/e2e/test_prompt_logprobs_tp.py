"""Prompt logprobs through a real worker service with tensor parallelism: a TP=2 worker (two
rank processes over gloo, symmetry checks on) computes them on every rank, the output rank's
reply carries them over the Step stream (the msgpack reply codec), and they equal transformers'
float32 ones, for a 60-token prompt prefilled in two chunks (48-token budget) beside a request
that asks for none."""
from __future__ import annotations

import pytest

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from tests.support.prompt_logprobs_reference import assert_matches_hf
from tests.support.tp_harness import make_core

pytestmark = pytest.mark.slow

PROMPTS = {"long": [(7 * i + 3) % 250 + 2 for i in range(60)], "short": [9, 4, 200, 31, 5]}


def test_tp2_prompt_logprobs_equal_transformers(tp2, tiny_models):
    model = tiny_models("llama")
    client = tp2.client(init_timeout_s=120.0, step_timeout_s=60.0)
    try:
        assert client.init(tp2.spec(model, verify_symmetry=True)).tp_size == 2, tp2.logs()
        core = make_core(model, client)
        eos = ModelInfo.from_dir(model).eos_token_ids
        asked = {"long": 3, "short": None}
        for rid, prompt in PROMPTS.items():
            core.add_request(Request(rid, list(prompt), SamplingParams(),
                                     StoppingParams(max_tokens=4, ignore_eos=True), eos,
                                     num_prompt_logprobs=asked[rid]))
        got = {rid: [] for rid in PROMPTS}
        for _ in range(200):
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                got[out.request_id].append(out)
    except Exception:
        print(tp2.logs())
        raise
    finally:
        client.close()
    assert not core.has_unfinished_requests()
    sent = [o.prompt_logprobs for o in got["long"] if o.prompt_logprobs is not None]
    assert len(sent) == 1 and got["long"][0].prompt_logprobs is sent[0]
    assert_matches_hf(sent[0], model, PROMPTS["long"], 3)
    assert all(o.prompt_logprobs is None for o in got["short"])
    assert sum(len(o.new_token_ids) for o in got["short"]) == 4
