"""OutputProcessor(final_only=True): one output per request, at its finish, equal field for
field to the merge of the per-step outputs the same updates give; the text decoded once at the
finish (byte-level decoder, no stop strings) equals the incremental text."""
import random

import pytest

from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_result import TokenUpdate
from scheduler_service.engine.output_processor import OutputProcessor, merge_outputs
from tests.support.tokenizers import _byte_token_ids, build_tiny_tokenizer_dir
from tests.unit.engine_common.text.test_tokenizer_edge_cases import byte_fallback  # noqa: F401

LEN, STOP_TOK, ABORTED = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOP_TOKEN,
                          RequestStatus.FINISHED_ABORTED)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return Tokenizer.from_dir(build_tiny_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def random_ids(rng, tok, split_ids, n):
    """Whole tokens, lone bytes of multi-byte characters, special tokens, ids past the
    tokenizer's vocabulary (a model's padded vocabulary can sample them)."""
    specials = [i for i in (tok.eos_token_id, tok.bos_token_id) if i is not None]
    return [rng.choice(split_ids) if rng.random() < 0.35 else
            rng.choice(specials) if rng.random() < 0.05 else
            tok.vocab_size + 3 if rng.random() < 0.02 else rng.randrange(tok.vocab_size)
            for _ in range(n)]


def random_updates(rng, rid, ids, finish, num_logprobs):
    """The engine's updates for `ids`: mostly one token a step, sometimes several; times set
    so both processors see the same ones."""
    updates, i = [], 0
    while i < len(ids) or not updates:
        part = ids[i:i + (1 if rng.random() < 0.8 else rng.randint(2, 4))]
        i += len(part)
        last = i >= len(ids)
        top = ([([t, 3, 4], [-0.5, -1.5, -2.5]) for t in part]
               if num_logprobs and rng.random() < 0.7 else None)
        updates.append(TokenUpdate(
            rid, part, [-0.01 * (i + k) for k in range(len(part))], top,
            finish if last else None, part[-1] if last and finish == STOP_TOK and part else None,
            2, 1.0, 2.0, 9.0 if last else None))
    if finish == ABORTED:                  # an abort carries no tokens of its own
        updates[-1].finish_reason, updates[-1].finish_time = None, None
        updates.append(TokenUpdate(rid, [], [], None, ABORTED, None, 2, 1.0, 2.0, 9.5))
    return updates


def outputs(tok, final_only, req, updates, stopped_at=None):
    """Every output of `req` for `updates` (fed one batch each, with a second request between
    them), and the update index a stop string was reported at."""
    proc = OutputProcessor(tok, final_only=final_only)
    other = Request("other", [5, 6], SamplingParams(), StoppingParams(max_tokens=None))
    proc.add_request(req)
    proc.add_request(other)
    outs = []
    for n, up in enumerate(updates):
        got, stopped = proc.process([TokenUpdate("other", [7], [-1.0], None, None, None, 0,
                                                 1.0, 2.0, None), up])
        outs += [o for o in got if o.request_id == req.request_id]
        if stopped:
            return outs, n
    return outs, None


def fields(out):
    return (out.request_id, out.new_token_ids, out.new_text, out.logprobs, out.finished,
            out.finish_reason, out.stop_reason, out.num_prompt_tokens, out.num_output_tokens,
            out.num_cached_tokens, out.timings, out.error)


def check_final_equals_merged(tok, rng, split_ids, trials):
    deferred = 0
    for trial in range(trials):
        stops = rng.choice([(), (), ("ab",), ("\u4f60", "o w")])
        include = rng.random() < 0.5
        num_logprobs = rng.choice([0, 2])
        finish = rng.choice([LEN, STOP_TOK, ABORTED])
        ids = random_ids(rng, tok, split_ids, rng.randrange(1, 60))
        updates = random_updates(rng, f"r{trial}", ids, finish, num_logprobs)

        def request():
            req = Request(f"r{trial}", tok.encode(rng_prompt), SamplingParams(),
                          StoppingParams(max_tokens=None, stop=stops,
                                         include_stop_str_in_output=include,
                                         min_tokens=rng_min),
                          num_logprobs=num_logprobs)
            req.arrival_time = 0.5
            return req

        rng_prompt, rng_min = rng.choice(["Q:", "x", "你好"]), rng.choice([0, 0, 5])
        per_step, stop_a = outputs(tok, False, request(), updates)
        final, stop_b = outputs(tok, True, request(), updates)
        merged = per_step[0]
        for out in per_step[1:]:
            merged = merge_outputs(merged, out)
        assert stop_a == stop_b
        assert len(final) == 1 and final[0].finished
        assert fields(final[0]) == fields(merged), (trial, ids, stops, finish)
        deferred += not stops
    return deferred


def test_byte_level_final_output_equals_merged_per_step_outputs(byte_level):
    # Without stop strings the text is decoded once at the finish; with them, token by token.
    proc = OutputProcessor(byte_level, final_only=True)
    proc.add_request(Request("d", [5], SamplingParams(), StoppingParams(max_tokens=None)))
    assert proc._states["d"].defer_text
    split_ids = _byte_token_ids(byte_level, "你好🙂é".encode())
    assert check_final_equals_merged(byte_level, random.Random(11), split_ids, 400) > 100


def test_sentencepiece_final_output_equals_merged_per_step_outputs(byte_fallback):  # noqa: F811
    tok, vocab = byte_fallback
    proc = OutputProcessor(tok, final_only=True)
    proc.add_request(Request("d", [5], SamplingParams(), StoppingParams(max_tokens=None)))
    assert not proc._states["d"].defer_text          # not byte-level: text token by token
    split_ids = [vocab[f"<0x{b:02X}>"] for b in "你好🙂é".encode()]
    check_final_equals_merged(tok, random.Random(12), split_ids, 250)


@pytest.mark.parametrize("skip", [True, False])
def test_deferred_text_equals_incremental_text(byte_level, skip):
    # The finish-time decode against the incremental detokenizer's pieces (a character left
    # unfinished at the end dropped from both), with the text of a stop token left out or kept,
    # special tokens skipped or not.
    rng = random.Random(5 + skip)
    split_ids = _byte_token_ids(byte_level, "你好🙂é".encode())
    for trial in range(300):
        ids = random_ids(rng, byte_level, split_ids, rng.randrange(1, 80))
        finish = rng.choice([LEN, STOP_TOK])
        include = rng.random() < 0.5
        texts = []
        for final_only in (False, True):
            proc = OutputProcessor(byte_level, final_only=final_only)
            req = Request("r", byte_level.encode(rng.choice(["Q:", "你"])), SamplingParams(),
                          StoppingParams(max_tokens=None, include_stop_str_in_output=include,
                                         skip_special_tokens=skip))
            proc.add_request(req)
            outs = []
            for i, t in enumerate(ids):
                last = i == len(ids) - 1
                outs += proc.process([TokenUpdate("r", [t], [], None, finish if last else None,
                                                  t if last and finish == STOP_TOK else None,
                                                  0, 1.0, 2.0, 3.0 if last else None)])[0]
            texts.append("".join(o.new_text for o in outs))
        assert texts[0] == texts[1], (trial, ids)


def test_final_only_failure_keeps_the_tokens_before_it(byte_level):
    # A detokenizer failing on a request's third token (stop strings: text made token by
    # token) ends it with the two tokens before, as the merged per-step outputs would.
    results = []
    for final_only in (False, True):
        proc = OutputProcessor(byte_level, final_only=final_only)
        req = Request("bad", [5], SamplingParams(), StoppingParams(max_tokens=None, stop=("zz",)))
        proc.add_request(req)
        detok, calls = proc._states["bad"].detokenizer, []
        real_add = detok.add

        def add(token_id, real_add=real_add, calls=calls):
            calls.append(token_id)
            if len(calls) == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return real_add(token_id)

        detok.add = add
        outs = []
        for i, t in enumerate([40, 41, 42, 43]):
            outs += proc.process([TokenUpdate("bad", [t], [-1.0], None, None, None, 0, 1.0, 2.0,
                                              None)])[0]
        merged = outs[0]
        for out in outs[1:]:
            merged = merge_outputs(merged, out)
        assert merged.finished and merged.error is not None and merged.new_token_ids == [40, 41]
        merged.timings = merged.error = None          # the failure's own time and message
        results.append(fields(merged))
    assert results[0] == results[1]
