"""OutputProcessor: streaming text, stop strings with hold-back, min_tokens, abort, logprobs."""
import random

import pytest

from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_result import TokenUpdate
from tests.support.tokenizers import _byte_token_ids
from tests.support.vllm_text import VllmTextModel

LEN, STOP_TOK, STOP_STR, ABORTED = (RequestStatus.FINISHED_LENGTH,
                                    RequestStatus.FINISHED_STOP_TOKEN,
                                    RequestStatus.FINISHED_STOP_STRING,
                                    RequestStatus.FINISHED_ABORTED)


def make_request(tok, rid="r", **stopping):
    return Request(rid, tok.encode("Q:"), SamplingParams(), StoppingParams(max_tokens=None,
                                                                            **stopping))


def update(req, ids, finish=None, stop_token=None, logprobs=None, top=None):
    """The engine's update for `ids` of `req` (finished with `finish`, if given)."""
    lps = [-1.0] * len(ids) if logprobs is None else logprobs
    return TokenUpdate(req.request_id, list(ids), lps, top, finish, stop_token, 0, None, None,
                       None)


def run(proc, req, ids, chunk=1, finish: RequestStatus | None = LEN, stop_token=None):
    """Feed `ids` in chunks like the engine would; finish with `finish` after the last chunk.
    Returns (outputs, ids fed). Stops early when a stop string is reported."""
    proc.add_request(req)
    outs, fed = [], []
    chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    for n, part in enumerate(chunks):
        fed.extend(part)
        last = n == len(chunks) - 1 and finish is not None
        got, stopped = proc.process([update(req, part, finish if last else None,
                                            stop_token if last else None)])
        outs.extend(got)
        if stopped:
            assert stopped == [req.request_id]
            break
    return outs, fed


def text_of(outs):
    return "".join(o.new_text for o in outs)


def chars(tok, text):
    """One token per byte: text arrives at most one character per token."""
    return _byte_token_ids(tok, text.encode())


def test_plain_stream_then_length(tok):
    proc = OutputProcessor(tok)
    ids = tok.encode("Hello 你好🙂 world")[1:]
    outs, _ = run(proc, make_request(tok), ids)
    assert text_of(outs) == tok.decode(ids)
    assert [o.num_output_tokens for o in outs] == list(range(1, len(ids) + 1))
    assert [t for o in outs for t in o.new_token_ids] == ids
    final = outs[-1]
    assert final.finished and final.finish_reason == LEN and not any(o.finished for o in outs[:-1])
    assert final.num_prompt_tokens == len(tok.encode("Q:"))
    assert final.timings.finish_time is not None
    assert len(proc) == 0


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok, include):
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["world"], include_stop_str_in_output=include)
    text = "Hello wor wor world and more"
    outs, fed = run(proc, req, chars(tok, text))
    final_text = "Hello wor wor world" if include else "Hello wor wor "
    sent = ""
    for o in outs:  # the hold-back never lets a partial stop string out
        sent += o.new_text
        assert final_text.startswith(sent)
    assert sent == final_text
    assert outs[-1].finished and outs[-1].finish_reason == STOP_STR
    assert outs[-1].stop_reason == "world"
    assert [t for o in outs for t in o.new_token_ids] == fed == chars(tok, "Hello wor wor world")
    assert len(proc) == 0


def test_multibyte_stop_string(tok):
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["好🙂"])
    outs, _ = run(proc, req, chars(tok, "你好你好🙂再见"))
    assert text_of(outs) == "你好你"
    assert all(o.new_text.count("\ufffd") == 0 for o in outs)


def test_min_tokens_delays_stop_strings(tok):
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["ab"], min_tokens=4)
    outs, fed = run(proc, req, chars(tok, "ab ab ab"))
    # The first "ab" completes at token 2 < min_tokens; the second at token 5.
    assert text_of(outs) == "ab " and len(fed) == 5
    assert outs[-1].finish_reason == STOP_STR


def test_min_tokens_match_may_start_before_threshold(tok):
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["xyz"], min_tokens=2)
    outs, fed = run(proc, req, chars(tok, "xyz!"))
    assert text_of(outs) == "" and len(fed) == 3 and outs[-1].stop_reason == "xyz"


def test_a_stop_string_ending_in_token_min_tokens_does_not_stop(tok):
    """As vLLM (and as stop ids here): only a token after the first min_tokens ends a request,
    so a stop string must end in the text of token min_tokens + 1 or later."""
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["xyz"], min_tokens=3)
    outs, fed = run(proc, req, chars(tok, "xyz!xyz"))
    assert text_of(outs) == "xyz!" and len(fed) == 7 and outs[-1].stop_reason == "xyz"


def test_earliest_completed_stop_wins(tok):
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["abcd", "bc"])
    outs, _ = run(proc, req, chars(tok, "xabcde"), chunk=6)
    assert text_of(outs) == "xa" and outs[-1].stop_reason == "bc"


def test_stops_completing_in_one_token_take_the_listed_order(tok):
    """vLLM's check_stop_strings: of the stop strings the same token completes, the first in
    the request's list wins ("ab" starts earlier, but "b" is listed first)."""
    for stops, text, reason in ((["b", "ab"], "xa", "b"), (["ab", "b"], "x", "ab")):
        proc = OutputProcessor(tok)
        outs, _ = run(proc, make_request(tok, stop=stops), chars(tok, "xaby"))
        assert (text_of(outs), outs[-1].stop_reason) == (text, reason)


def test_held_back_text_flushed_on_other_finish(tok):
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["never-seen"])
    outs, _ = run(proc, req, chars(tok, "Hello there"))
    assert text_of(outs[:-1]) == "H"  # 10 characters in, 9 held back
    assert text_of(outs) == "Hello there" and outs[-1].finish_reason == LEN


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_excluded(tok, include):
    proc = OutputProcessor(tok)
    bang = chars(tok, "!")[0]
    req = make_request(tok, stop_token_ids=[bang], include_stop_str_in_output=include)
    outs, _ = run(proc, req, chars(tok, "ok!"), finish=STOP_TOK, stop_token=bang)
    assert text_of(outs) == ("ok!" if include else "ok")
    assert outs[-1].finish_reason == STOP_TOK and outs[-1].stop_reason == bang
    assert outs[-1].new_token_ids == [bang]


def test_a_stop_tokens_own_text_is_matched_against_stop_strings(tok):
    """As vLLM: with include_stop_str_in_output the stop token's text is detokenized and
    checked like any other (detokenizer.update(ids, stop_terminated) runs check_stop_strings on
    it), so a stop string in it names the finish and cuts the text after itself."""
    ll = tok.encode("hello", add_special_tokens=False)[1]
    assert tok.decode([ll]) == "ll"
    for stops, text, reason in ((["l"], "okl", "l"), (["ll"], "okll", "ll"), (["z"], "okll", ll)):
        proc = OutputProcessor(tok)
        req = make_request(tok, stop=stops, stop_token_ids=[ll], include_stop_str_in_output=True)
        outs, _ = run(proc, req, chars(tok, "ok") + [ll], finish=STOP_TOK, stop_token=ll)
        assert (text_of(outs), outs[-1].stop_reason) == (text, reason)
        assert outs[-1].finish_reason == (STOP_TOK if reason == ll else STOP_STR)


def test_stop_string_in_the_step_that_hits_length(tok):
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["end"])
    outs, _ = run(proc, req, chars(tok, "the end."), chunk=8)
    assert len(outs) == 1 and outs[0].finish_reason == STOP_STR and outs[0].new_text == "the "
    assert outs[0].stop_reason == "end" and len(proc) == 0


def test_abort_flushes_and_forgets(tok):
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["zzzz"])
    outs, _ = run(proc, req, chars(tok, "Hello"), finish=None)
    assert text_of(outs) == "He"  # three characters held back
    (final,), stopped = proc.process([update(req, [], ABORTED)])
    assert final.finished and final.finish_reason == ABORTED and final.new_text == "llo"
    assert final.num_output_tokens == 5 and final.new_token_ids == [] and stopped == []
    assert len(proc) == 0 and proc.process([update(req, [], ABORTED)]) == ([], [])
    assert proc.process([update(req, [5])]) == ([], [])


def test_tokens_after_a_stop_string_are_dropped(tok):
    """The engine hears of a stop string a step or two late: those tokens never come out."""
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["ab"])
    proc.add_request(req)
    a, b, c = chars(tok, "abc")
    outs, stopped = proc.process([update(req, [a]), update(req, [b])])
    assert stopped == [req.request_id] and outs[-1].finish_reason == STOP_STR
    assert outs[-1].num_output_tokens == 2
    assert proc.process([update(req, [c]), update(req, [c], LEN)]) == ([], [])


def test_request_fields_are_read_once_and_never_written(tok):
    """The engine thread owns the Request after add_request: the processor copies what it needs
    then and never writes to it (a stop string's status is the engine's to set)."""
    proc = OutputProcessor(tok)
    req = make_request(tok, stop=["b"])
    proc.add_request(req)
    before = vars(req).copy()
    outs, stopped = proc.process([update(req, chars(tok, "ab"))])
    assert stopped == ["r"] and outs[-1].stop_reason == "b" and vars(req) == before


def test_random_chunking_matches_reference(tok):
    rng = random.Random(7)
    alphabet = ["a", "b", " ", "你", "好", "🙂", "é", "x"]
    for trial in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(0, 3))]
        include = rng.random() < 0.5
        ids = chars(tok, text) if rng.random() < 0.5 else tok.encode(text)[1:]
        proc = OutputProcessor(tok)
        req = make_request(tok, f"r{trial}", stop=stops, include_stop_str_in_output=include)
        outs, fed = run(proc, req, ids, chunk=rng.randrange(1, 5))
        expected, stop = _reference_cut(tok, ids, stops, include)
        assert text_of(outs) == expected, (text, stops, include)
        assert outs[-1].finished and outs[-1].stop_reason == stop
        # Several tokens in one update (speculative decoding) end where one at a time would
        # have: at the token whose text completed the stop string.
        one_by_one = run(OutputProcessor(tok), make_request(
            tok, f"r{trial}", stop=stops, include_stop_str_in_output=include), ids)[1]
        assert [t for o in outs for t in o.new_token_ids] == one_by_one
        assert outs[-1].num_output_tokens == len(one_by_one)
        assert len(proc) == 0


def _reference_cut(tok, ids, stops, include):
    """vLLM's rule: after each token's text, the first listed stop string found in the text
    that token completed wins, at its first place there (check_stop_strings)."""
    text = tok.decode(ids)
    ends = sorted({len(t) for t in (tok.decode(ids[:k]) for k in range(1, len(ids) + 1))
                   if not t.endswith("\ufffd")} | {len(text)})
    done = 0
    for end in ends:
        for s in stops:
            pos = text.find(s, max(0, done - len(s) + 1), end)
            if pos >= 0:
                return text[:pos + len(s) if include else pos], s
        done = end
    return text, None


def test_logprobs_trimmed_to_request(tok):
    proc = OutputProcessor(tok)
    req = make_request(tok)
    req.num_logprobs = 2
    proc.add_request(req)
    top = [([7, 8, 9], [-0.1, -2.0, -3.0]), ([4, 5, 6], [-0.5, -1.0, -4.0])]
    (out,), _ = proc.process([update(req, [7, 5], None, None, [-0.1, -1.0], top)])
    assert [(lp.token_id, lp.logprob) for lp in out.logprobs] == [(7, -0.1), (5, -1.0)]
    assert out.logprobs[1].top_token_ids == [4, 5] and out.logprobs[1].top_logprobs == [-0.5, -1.0]
    assert out.timings.first_token_time is not None and not out.finished


def test_steady_path_gives_the_general_paths_outputs(tok):
    # One-token updates of a request without stop strings take process()'s inline path after
    # the first; the same updates with (empty, unasked-for) top alternatives take the general
    # one. Every field of every output agrees, on text with characters split across tokens.
    rng = random.Random(3)
    byte_ids = chars(tok, "你好🙂é")
    ids = [rng.choice(byte_ids) if rng.random() < 0.4 else rng.randrange(3, tok.vocab_size)
           for _ in range(300)]
    results = []
    for top in (None, [([], [])]):
        proc = OutputProcessor(tok)
        req = make_request(tok)
        req.arrival_time = 0.5
        proc.add_request(req)
        outs = []
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            up = TokenUpdate(req.request_id, [t], [-0.25 * (i % 5)], top, LEN if last else None,
                             None, 3, 1.0, 2.0, 9.0 if last else None)
            outs.extend(proc.process([up])[0])
        results.append([(o.new_token_ids, o.new_text, o.logprobs, o.finished, o.finish_reason,
                         o.num_output_tokens, o.num_cached_tokens, o.timings) for o in outs])
    assert results[0] == results[1]
    # vLLM's text (tokenizers' DecodeStream stepped): decode's, less a character left unfinished
    model = VllmTextModel(tok, tok.encode("Q:"), [], False)
    model.update(ids, False)
    assert "".join(r[1] for r in results[0]) == model.text
