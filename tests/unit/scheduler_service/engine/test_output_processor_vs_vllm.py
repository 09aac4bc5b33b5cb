"""The OutputProcessor's streamed text step by step against a model of vLLM v1's
(tests/support/vllm_text.py): the hold-back only when stop strings are cut, no hold-back with
include_stop_str_in_output, and no U+FFFD for a character the generation left unfinished."""
import random

import pytest

from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_result import TokenUpdate
from scheduler_service.engine.output_processor import OutputProcessor
from tests.support.tokenizers import _byte_token_ids
from tests.support.vllm_text import VllmTextModel
from tests.unit.engine_common.text.test_tokenizer_edge_cases import byte_fallback  # noqa: F401

LEN, STOP_TOK, STOP_STR = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOP_TOKEN,
                           RequestStatus.FINISHED_STOP_STRING)


def stream(tok, ids, chunk=1, finish=LEN, final_only=False, **stopping):
    """(our outputs, vLLM's DELTA texts, vLLM's stop string) for `ids` fed `chunk` at a time,
    the last chunk finishing with `finish`; both stop at a matched stop string."""
    req = Request("r", tok.encode("Q:"), SamplingParams(),
                  StoppingParams(max_tokens=None, **stopping))
    model = VllmTextModel(tok, req.prompt_token_ids, list(req.stopping.stop),
                          req.stopping.include_stop_str_in_output, req.stopping.min_tokens)
    proc = OutputProcessor(tok, final_only=final_only)
    proc.add_request(req)
    outs, deltas, matched = [], [], None
    chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    for n, part in enumerate(chunks):
        last = n == len(chunks) - 1
        reason = finish if last else None
        stop_token = part[-1] if last and finish == STOP_TOK else None
        got, _ = proc.process([TokenUpdate("r", part, [-1.0] * len(part), None, reason,
                                           stop_token, 0, None, None, None)])
        outs += got
        matched = model.update(part, reason == STOP_TOK)
        deltas.append(model.delta(finished=last or matched is not None))
        if matched is not None:
            break
    return outs, deltas, matched


def chars(tok, text: str) -> list[int]:
    return _byte_token_ids(tok, text.encode())


@pytest.mark.parametrize("include", [False, True])
def test_each_steps_text_is_vllms(tok, include):
    outs, deltas, matched = stream(tok, chars(tok, "Hello wor wor world and more"),
                                   stop=["world"], include_stop_str_in_output=include)
    assert [o.new_text for o in outs] == deltas and matched == "world"
    if include:     # vLLM holds nothing back: every character goes out with its own token
        assert deltas[:4] == ["H", "e", "l", "l"]
        assert "".join(deltas) == "Hello wor wor world"
    else:           # the last len("world") - 1 characters wait
        assert deltas[:5] == ["", "", "", "", "H"]
        assert "".join(deltas) == "Hello wor wor "


def test_included_stop_string_may_begin_in_text_already_sent(tok):
    """Nothing is held back with include_stop_str_in_output, so "ab" goes out before "c"
    completes "abc"; the match still counts, and the text ends at the stop string's end."""
    outs, deltas, _ = stream(tok, chars(tok, "xabcz"), stop=["abc"],
                             include_stop_str_in_output=True)
    assert [o.new_text for o in outs] == deltas == ["x", "a", "b", "c"]
    assert outs[-1].finish_reason == STOP_STR and outs[-1].stop_reason == "abc"


def test_unfinished_character_at_the_end_is_not_sent(tok):
    """As vLLM: bytes of a character the last tokens left unfinished never become text (no
    U+FFFD); the same on the final-only path, whose text is decoded once at the finish."""
    ids = chars(tok, "ab你")[:-1]
    assert tok.decode(ids) == "ab\ufffd"
    for final_only in (False, True):
        outs, deltas, _ = stream(tok, ids, final_only=final_only)
        assert "".join(o.new_text for o in outs) == "".join(deltas) == "ab"
        assert outs[-1].finished and outs[-1].new_token_ids[-1:] == ids[-1:]
    # an invalid byte mid-text is text (vLLM streams it), only the unfinished end is not
    ids = chars(tok, "a") + chars(tok, "你")[:1] + chars(tok, "b") + chars(tok, "好")[:2]
    outs, deltas, _ = stream(tok, ids)
    assert "".join(o.new_text for o in outs) == "".join(deltas) == "a\ufffdb"


def test_random_streams_match_vllm_step_by_step(tok):
    """Random texts (whole tokens or one token per byte, cut anywhere, even inside a
    character), stop strings, include_stop_str_in_output, min_tokens, finishes on length or on
    a stop token. With several tokens a step, one stop string (vLLM looks once per step, this
    processor after each token: the same with one string)."""
    rng = random.Random(11)
    alphabet = ["a", "b", " ", "你", "好", "🙂", "é", "x"]
    for trial in range(250):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 20)))
        ids = chars(tok, text) if rng.random() < 0.5 else tok.encode(text)[1:]
        ids = ids[:rng.randrange(1, len(ids) + 1)]
        chunk = 1 if rng.random() < 0.6 else rng.randrange(2, 5)
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5)))
                 for _ in range(rng.randrange(0, 4 if chunk == 1 else 2))]
        include = rng.random() < 0.5
        finish = LEN if rng.random() < 0.7 else STOP_TOK
        min_tokens = rng.choice([0, 0, 2, 5])
        outs, deltas, matched = stream(tok, ids, chunk, finish, stop=stops,
                                       include_stop_str_in_output=include,
                                       min_tokens=min_tokens)
        case = (text, ids, chunk, stops, include, finish, min_tokens)
        assert [o.new_text for o in outs] == deltas, case
        final = outs[-1]
        assert final.finished and len(outs) == len(deltas), case
        if matched is not None:        # vLLM: finish_reason "stop", stop_reason the string
            assert (final.finish_reason, final.stop_reason) == (STOP_STR, matched), case
        else:
            assert final.finish_reason == finish, case


def test_sentencepiece_streams_match_vllm_step_by_step(byte_fallback):  # noqa: F811
    """The same on a ByteFallback (Llama 2 style) decoder, whose text depends on its place
    (DecodeStream kept): words, whole characters spelled in byte tokens (the last maybe cut
    short), special tokens. (A stray byte that makes DecodeStream refuse is where vLLM's
    recovery and ours differ: docs/serving_text_path.md.)"""
    tok, vocab = byte_fallback
    rng = random.Random(5)
    words = [vocab[w] for w in ("▁Hello", "▁world", "▁", "a", "b", "x")]
    for trial in range(200):
        ids = []
        while len(ids) < rng.randrange(1, 16):
            if rng.random() < 0.4:
                ids += [vocab[f"<0x{b:02X}>"] for b in rng.choice("你好🙂é").encode()]
            else:
                ids.append(rng.choice(words) if rng.random() < 0.9 else vocab["</s>"])
        ids = ids[:rng.randrange(1, len(ids) + 1)]
        stops = rng.choice([[], ["o w"], ["你"], ["l", "ld"]])
        include = rng.random() < 0.5
        outs, deltas, _ = stream(tok, ids, stop=stops, include_stop_str_in_output=include)
        assert [o.new_text for o in outs] == deltas, (ids, stops, include)
