"""Drafts for a constrained request on a real ModelRunner (tiny qwen3, fp32, its real tokenizer):
each draft position is drawn under the mask of the grammar after the drafts before it, so a
drafted step gives the tokens of one-token constrained steps; a draft the grammar forbids is
rejected there; a grammar that completes inside the drafts ends with eos at that position; the
matcher then follows the accepted run (the next steps' masks are right)."""
from __future__ import annotations

import pytest

from engine_common.constraints.constraint import Constraint
from engine_common.wire.diff import SchedulerOutput
from engine_common.request.params import SamplingParams, WorkerSamplingParams
from tests.support.garbage_diffs import GREEDY, PROMPT, new
from worker_service.config import RunnerConfig
from worker_service.runner import model_runner
from worker_service.runner.model_runner import ModelRunner

LIMITS = dict(block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
REGEX = Constraint("regex", "[0-9]{6}-[a-z]{6}")


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models("qwen3")


def _runner(model: str) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model_dir=model, dtype="float32", **LIMITS))
    runner.init_kv_cache(64)
    return runner


def _prefill(runner: ModelRunner, sampling=GREEDY) -> int:
    out = runner.execute_diff(SchedulerOutput(
        0, new_requests=[new(blocks=list(range(12)), constraint=REGEX, logprobs=2,
                             sampling=sampling)],
        num_scheduled_tokens={0: len(PROMPT)}))
    return out.sampled_token_ids[0]


@pytest.fixture(scope="module")
def reference(model):
    """One-token constrained greedy steps until eos: the tokens, and each step's reply."""
    ref = _runner(model)
    tokens, outs = [_prefill(ref)], []
    eos = set(ref.grammar.compiler.eos_token_ids)
    while tokens[-1] not in eos:
        outs.append(ref.execute_diff(SchedulerOutput(len(tokens))))
        tokens.append(outs[-1].sampled_token_ids[0])
        assert len(tokens) < 30, "the grammar never ended"
    return tokens, outs, ref.grammar.compiler


def _step(run: ModelRunner, step: int, drafts: list[int]):
    return run.execute_diff(SchedulerOutput(step, num_scheduled_tokens={0: 1 + len(drafts)},
                                            spec_token_ids={0: drafts}))


def test_right_drafts_are_accepted_under_each_positions_mask(model, reference):
    tokens, outs, _ = reference
    assert len(tokens) >= 7             # the text in at least 6 tokens, then eos
    run = _runner(model)
    assert _prefill(run) == tokens[0]
    out = _step(run, 1, tokens[1:5])     # all right: 4 accepted plus the bonus
    assert out.sampled_token_ids == tokens[1:6]
    # the logprobs and top alternatives are those of the one-token steps
    ids, _ = out.top_logprobs[0]
    assert [int(i) for i in ids] == [int(i) for o in outs[:5] for i in o.top_logprobs[0][0]]
    assert max(abs(a - o.logprobs[0]) for a, o in zip(out.logprobs, outs)) < 1e-5
    # the matcher followed the run: the rest to eos as one-token decoding
    rest = []
    while not rest or rest[-1] != tokens[-1]:
        rest += run.execute_diff(SchedulerOutput(2 + len(rest))).sampled_token_ids
        assert len(rest) < 30
    assert rest == tokens[6:]
    assert run.grammar._live[0].terminated


def test_a_draft_the_grammar_forbids_is_rejected(model, reference, monkeypatch):
    """...and never computed: the drafts from the refused one on are cut before the forward
    (grammar_trim: the row's draw at the refused draft's position is its last either way)."""
    tokens, _, compiler = reference
    letter = compiler.tokenizer.tokenize_str("q")[0]       # where the regex wants a digit
    run = _runner(model)
    _prefill(run)
    seen = []                                             # each step's draws
    build = model_runner.build_sampling_metadata
    monkeypatch.setattr(model_runner, "build_sampling_metadata",
                        lambda *a: seen.append(len(a[1])) or build(*a))
    out = _step(run, 1, [tokens[1], letter, tokens[3]])
    assert out.sampled_token_ids == tokens[1:3]            # 1 accepted, then the correction
    assert seen == [2]                  # drawn after the last token and after the first draft
    out = _step(run, 2, [letter, tokens[4]])               # refused at once: one token
    assert out.sampled_token_ids == tokens[3:4] and seen == [2, 1]
    assert run.grammar._live[0].num_consumed == 4
    row = run.batch.handle_to_row[0]
    assert run.batch.num_tokens[row] == len(PROMPT) + 4
    assert run.grammar.take_errors() == {}
    out = _step(run, 3, tokens[4:6])
    assert out.sampled_token_ids == tokens[4:7]


@pytest.mark.parametrize("min_tokens", [0, 40])
def test_a_grammar_that_ends_inside_the_drafts_stops_there(model, reference, min_tokens,
                                                          monkeypatch):
    """Drafts running past the grammar's end: the eos position draws eos (the only id its
    mask allows), whatever the draft there; with min_tokens far beyond it too (the grammar
    wins: that draft position counts as stopped, so min_tokens does not mask eos there)."""
    tokens, _, compiler = reference
    end = len(tokens) - 1                                 # eos's index
    eos = tuple(sorted(compiler.eos_token_ids))
    run = _runner(model)
    _prefill(run, WorkerSamplingParams(SamplingParams(), seed=0, min_tokens=min_tokens,
                                       stop_ids=eos))
    done, step = 1, 1
    while end - done > 3:                                 # up to 3 tokens before eos
        done += len(_step(run, step, tokens[done:done + 2]).sampled_token_ids)
        step += 1
    seen = []                # each step's grammar_done, per draw (the sampling row, then drafts)
    build = model_runner.build_sampling_metadata
    monkeypatch.setattr(model_runner, "build_sampling_metadata",
                        lambda *a: seen.append(a[4].tolist()) or build(*a))
    out = _step(run, step, tokens[done:end] + [tokens[1]])   # a text token where eos must be
    m = end - done                      # eos is drawn at draft position m
    # the drafts from the refused text token on are cut (grammar_trim): the row's draw
    # after the m drafts, at the eos position, is its last
    assert seen[-1] == [True] + [False] * m
    assert out.sampled_token_ids == tokens[done:end + 1]
    assert out.sampled_token_ids[-1] in compiler.eos_token_ids
    assert run.grammar._live[0].terminated and run.grammar.take_errors() == {}
