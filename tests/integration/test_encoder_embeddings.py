"""Encoder embedding models (BertModel, XLMRobertaModel) through LLM(runner="pooling").embed,
against transformers' AutoModel on the same tiny random weights pooled as sentence-transformers
pools them (float32, CPU; tests/support/encoder_models.py):

  - prompts of mixed lengths in one step, and a token budget that spreads them over several
    steps (each prompt whole in one), equal the reference within 1e-5, for CLS and MEAN;
  - text is tokenized as transformers' tokenizer does ([CLS] ... [SEP], <s> ... </s>); RoBERTa
    positions as transformers numbers them (a pad id inside a prompt too);
  - a prompt of max_model_len tokens (every position) is served; longer ones, and ones over
    the step's token budget, are refused naming the limit; generate is refused;
  - nothing samples (the sampler is never called, no token comes out) and no KV block is held
    after; the same holds for a decoder's pooling requests.
"""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.pooling import POOL_SAMPLING, POOL_STOPPING, PoolerConfig
from scheduler_service.core.admission import RequestRejected
from scheduler_service.core.request import Request
from tests.support.encoder_models import (MAX_POSITIONS, make_encoder_model, reference_ids,
                                          reference_vectors)
from worker_service.batch.diff_check import BadDiff

TEXTS = ["Hello world, how are you today?", "the quick brown fox", "KV cache",
         "Embeddings map a sentence to a vector; similar texts lie close together."]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """(arch, pooling) -> a model directory, built once per module."""
    root, made = tmp_path_factory.mktemp("encoders"), {}

    def get(arch: str, pooling: str | None = None, normalize: bool = True) -> str:
        key = (arch, pooling, normalize)
        if key not in made:
            made[key] = str(make_encoder_model(root / f"{arch}-{len(made)}", arch, pooling,
                                               normalize))
        return made[key]
    return get


def encoder_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, dtype="float32", max_num_seqs=8, runner="pooling", **kwargs)


def prompts_for(model_dir: str) -> list[list[int]]:
    """Mixed lengths: the texts' ids, one of max_model_len, a one-token one."""
    ids = reference_ids(model_dir, TEXTS)
    return ids + [[5 + i % 40 for i in range(MAX_POSITIONS)], ids[0][:1]]


def assert_vectors(got, expected) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(torch.tensor(g.embedding), e, rtol=0, atol=1e-5)


def never_samples(llm: LLM) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a pooling step sampled (LM head rows computed)")
    llm.runner.sampler.from_model_output = refuse


def assert_nothing_held(llm: LLM) -> None:
    assert llm.scheduler.kv.pool.num_free_blocks == llm.scheduler.num_total_blocks
    assert not llm.runner.pooling and not llm.runner.requests


@pytest.mark.parametrize("arch", ["bert", "xlmr"])
@pytest.mark.parametrize("pooling, normalize", [("CLS", True), ("MEAN", True), ("MEAN", False)])
@pytest.mark.parametrize("budget", [512, MAX_POSITIONS])
def test_vectors_match_transformers(encoders, arch, pooling, normalize, budget):
    model = encoders(arch, pooling, normalize)
    llm = encoder_llm(model, max_num_batched_tokens=budget)
    assert llm.pooler == PoolerConfig(pooling, normalize, whole_prompt=True)
    assert llm.model_info.max_model_len == MAX_POSITIONS      # XLM-R: 66 positions - 2
    never_samples(llm)
    prompts = prompts_for(model)
    steps = []
    schedule = llm.scheduler.schedule
    llm.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    assert_vectors(llm.embed(prompts), reference_vectors(model, prompts, pooling, normalize))
    computed = [d for d in steps if d.new_requests]
    assert len(computed) == (1 if budget == 512 else len(computed)) and len(computed) >= 1
    if budget == MAX_POSITIONS:
        assert len(computed) > 2            # spread over steps, each prompt whole in one
    for diff in computed:
        for new in diff.new_requests:
            n = diff.num_scheduled_tokens.get(new.handle, 1)
            assert n == len(new.prompt_token_ids) and new.num_computed_tokens == 0
    hits = llm.scheduler.kv.stats.hits
    assert_vectors(llm.embed(prompts[:2]), reference_vectors(model, prompts[:2], pooling,
                                                             normalize))
    assert llm.scheduler.kv.stats.hits == hits          # never a prefix hit
    assert_nothing_held(llm)


@pytest.mark.parametrize("arch", ["bert", "xlmr"])
def test_text_is_tokenized_as_transformers_and_cls_is_the_default(encoders, arch):
    model = encoders(arch)                                   # no sentence-transformers files
    llm = encoder_llm(model)
    assert llm.pooler == PoolerConfig("CLS", True, whole_prompt=True)    # vLLM's default
    never_samples(llm)
    outs = llm.embed(TEXTS)
    ids = reference_ids(model, TEXTS)
    assert [o.prompt_token_ids for o in outs] == ids
    assert_vectors(outs, reference_vectors(model, ids, "CLS", True))
    assert_nothing_held(llm)


@pytest.mark.parametrize("arch", ["bert", "xlmr"])
def test_a_masked_lm_checkpoint_embeds_with_its_encoder(tmp_path, arch):
    """BertForMaskedLM / XLMRobertaForMaskedLM: the `bert.` / `roberta.` prefix dropped, the
    MaskedLM head skipped; the vectors are AutoModel's (the same encoder weights)."""
    model = str(make_encoder_model(tmp_path / arch, arch, "MEAN", masked_lm=True))
    llm = encoder_llm(model)
    prompts = prompts_for(model)[:3]
    assert_vectors(llm.embed(prompts), reference_vectors(model, prompts, "MEAN", True))


def test_a_pad_id_inside_an_xlmr_prompt_takes_transformers_positions(encoders):
    """RoBERTa numbers only non-pad ids (a pad id takes the pad position), per request."""
    model = encoders("xlmr", "MEAN")
    prompts = [[0, 5, 1, 1, 6, 7, 2], [0, 1, 9, 2], [0, 8, 2]]      # pad id 1 inside
    assert_vectors(encoder_llm(model).embed(prompts),
                   reference_vectors(model, prompts, "MEAN", True))


def test_limits_and_generation_are_refused(encoders):
    model = encoders("bert", "MEAN")
    with pytest.raises(ValueError, match="BertModel is an encoder.*--runner pooling"):
        LLM(model, dtype="float32")
    llm = encoder_llm(model, max_num_batched_tokens=32)
    with pytest.raises(RequestRejected) as err:
        llm.embed([[5] * (MAX_POSITIONS + 1)])
    assert (err.value.field, err.value.value) == ("prompt tokens", MAX_POSITIONS + 1)
    assert f"max_model_len ({MAX_POSITIONS})" in err.value.allowed
    with pytest.raises(RequestRejected) as err:
        llm.embed([[5] * 33])
    assert (err.value.field, err.value.value) == ("prompt tokens", 33)
    assert "max_num_batched_tokens (32)" in err.value.allowed
    with pytest.raises(ValueError, match="runner='pooling'.*does not generate"):
        llm.generate([[5, 6, 7]])
    ids = [[5] * 32, [6] * 20]                              # at the budget: served
    assert_vectors(llm.embed(ids), reference_vectors(model, ids, "MEAN", True))
    assert_nothing_held(llm)


def test_a_generation_request_reaching_an_encoder_worker_is_refused(encoders):
    """The worker refuses a diff whose new request has no pooling (no LM head to sample)."""
    llm = encoder_llm(encoders("bert"))
    eos = llm.model_info.eos_token_ids
    llm.engine.add_request(Request("gen", [2, 5, 6], POOL_SAMPLING, POOL_STOPPING, eos))
    with pytest.raises(BadDiff, match="pooling.*no LM head"):
        llm.engine.step()


def test_a_decoders_pooling_requests_sample_nothing(tiny_models):
    """The same rule on a decoder: pooling rows never reach the sampler (no LM-head row), no
    token comes out, the request ends on its vector."""
    model = tiny_models("qwen3")
    llm = LLM(model, dtype="float32", num_kv_blocks=64, max_num_seqs=8, runner="pooling",
              max_num_batched_tokens=16)
    never_samples(llm)
    eos = llm.model_info.eos_token_ids
    llm.engine.add_request(Request("p", list(range(3, 40)), POOL_SAMPLING, POOL_STOPPING, eos,
                                   num_logprobs=None, pooling=llm.pooler.code))
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert len(outs) == 1 and outs[0].finished and outs[0].embedding is not None
    assert outs[0].new_token_ids == [] and outs[0].new_text == ""
    llm._drop_finished()                     # the workers hear of the finish in a next step
    assert_nothing_held(llm)
