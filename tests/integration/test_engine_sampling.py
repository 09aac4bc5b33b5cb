"""Seeded sampling, stop conditions and logprobs through the whole in-process engine."""
from __future__ import annotations

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request, RequestStatus
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import hf_greedy

PROMPT = [5, 17, 99, 42, 7, 300, 12, 8, 77]
OTHERS = [[11, 12, 13], list(range(40, 90)), [200] * 7, list(range(100, 133))]


def _llm(tiny_models) -> tuple[LLM, str]:
    model = tiny_models("qwen3")
    return LLM(model, dtype="float32", num_kv_blocks=128), model


def test_seed_gives_same_tokens_alone_and_in_a_batch(tiny_models):
    llm, _ = _llm(tiny_models)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    st = StoppingParams(max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], sp, st)[0].token_ids
    others = [SamplingParams(temperature=1.3, seed=7), SamplingParams(),
              SamplingParams(temperature=0.5, min_p=0.1, seed=99),
              SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=3)]
    batch = llm.generate(OTHERS[:2] + [PROMPT] + OTHERS[2:],
                         others[:2] + [sp] + others[2:], [st] * 5)
    assert batch[2].token_ids == alone
    other_seed = llm.generate([PROMPT], SamplingParams(temperature=0.9, top_p=0.95, top_k=50,
                                                        seed=4321), st)[0].token_ids
    assert other_seed != alone, "a different seed should draw a different continuation"
    assert_no_leaked_blocks(llm)


def test_stop_token_and_min_tokens(tiny_models):
    llm, model = _llm(tiny_models)
    ref = list(hf_greedy(model, tuple(PROMPT), 12).token_ids)
    stop_id = ref[3]
    first = ref.index(stop_id)
    out = llm.generate([PROMPT], SamplingParams(),
                       StoppingParams(max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == RequestStatus.FINISHED_STOP_TOKEN
    assert out.stop_reason == stop_id
    assert out.token_ids == ref[:first + 1]
    # min_tokens masks the stop id until enough tokens exist, so generation runs on.
    late = llm.generate([PROMPT], SamplingParams(),
                        StoppingParams(max_tokens=12, min_tokens=first + 2,
                                       stop_token_ids=[stop_id]))[0]
    assert len(late.token_ids) >= first + 2
    assert stop_id not in late.token_ids[:first + 2]
    assert_no_leaked_blocks(llm)


def test_max_tokens_finishes_with_length(tiny_models):
    llm, _ = _llm(tiny_models)
    out = llm.generate([PROMPT], SamplingParams(), StoppingParams(max_tokens=5,
                                                                  ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == RequestStatus.FINISHED_LENGTH
    assert_no_leaked_blocks(llm)


def test_stop_string_trims_text(tiny_models):
    llm, _ = _llm(tiny_models)
    st = StoppingParams(max_tokens=12, ignore_eos=True)
    full = llm.generate([PROMPT], SamplingParams(), st)[0]
    assert len(full.text) >= 4, full.text
    stop = full.text[2:4]
    cut = llm.generate([PROMPT], SamplingParams(),
                       StoppingParams(max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == RequestStatus.FINISHED_STOP_STRING
    assert cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    assert_no_leaked_blocks(llm)


def test_logprobs_match_transformers(tiny_models):
    import torch
    from transformers import AutoModelForCausalLM

    llm, model = _llm(tiny_models)
    out = llm.generate([PROMPT], SamplingParams(), StoppingParams(max_tokens=4, ignore_eos=True),
                       num_logprobs=3)[0]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits[len(PROMPT) - 1:-1].float(), dim=-1)
    assert len(out.logprobs) == 4
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - float(ref[i, lp.token_id])) < 1e-4
        top = ref[i].topk(3)
        assert lp.top_token_ids == top.indices.tolist()
        assert all(abs(a - b) < 1e-4 for a, b in zip(lp.top_logprobs, top.values.tolist()))
    assert_no_leaked_blocks(llm)


def test_reset_prefix_cache_makes_the_next_run_compute_its_prompt(tiny_models):
    """After a run the prompt's full blocks are cached and a repeat hits them; after
    reset_prefix_cache() the repeat finds none, and its tokens are the same."""
    llm, _ = _llm(tiny_models)
    prompt = list(range(100, 140))          # 40 tokens: at least two full blocks
    st = StoppingParams(max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], SamplingParams(), st)[0].token_ids
    probe = Request("probe", prompt, SamplingParams(), st, [])
    assert llm.scheduler.kv.get_computed_blocks(probe)[1] > 0
    assert llm.reset_prefix_cache()
    assert llm.scheduler.kv.get_computed_blocks(probe)[1] == 0
    assert llm.generate([prompt], SamplingParams(), st)[0].token_ids == first
    assert_no_leaked_blocks(llm)


def test_the_tokenizers_eos_stops_whatever_generation_config_names(tiny_models, tmp_path):
    """vLLM stops at the tokenizer's eos even where generation_config.json names another (a
    chat fine-tune's <|im_end|> over the base model's </s>); it ran on to max_tokens here."""
    import json
    import shutil

    model = shutil.copytree(tiny_models("qwen3"), tmp_path / "model")
    gen = json.loads((model / "generation_config.json").read_text())
    tok_eos = gen["eos_token_id"]
    gen["eos_token_id"] = tok_eos + 1
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(model), dtype="float32", num_kv_blocks=32)
    assert llm.model_info.eos_token_ids == (tok_eos + 1, tok_eos)
    for allowed in (tok_eos, tok_eos + 1):        # only that id can be sampled
        out = llm.generate([PROMPT], SamplingParams(allowed_token_ids=(allowed,)),
                           StoppingParams(max_tokens=6))[0]
        assert out.token_ids == [allowed]
        assert out.finish_reason == RequestStatus.FINISHED_STOP_TOKEN
