"""StoppingParams.skip_special_tokens per request (vLLM's SamplingParams field): the text, and
so stop-string matching, leaves special tokens out by default and keeps their text when false.
The reference is the tokenizer's own decode with the same flag."""
from __future__ import annotations

import pytest

from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_result import TokenUpdate
from scheduler_service.engine.output_processor import OutputProcessor
from tests.support.tokenizers import build_tiny_tokenizer_dir

LEN = RequestStatus.FINISHED_LENGTH


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(build_tiny_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def run(tok, ids, stopping, final_only=False):
    """Feed `ids` a token a step; the joined text, the last output, the ids that matched."""
    proc = OutputProcessor(tok, final_only=final_only)
    proc.add_request(Request("r", tok.encode("Q:"), SamplingParams(), stopping))
    texts, last, stopped = [], None, []
    for i, t in enumerate(ids):
        end = i == len(ids) - 1
        outs, ids_stopped = proc.process([TokenUpdate("r", [t], [], None, LEN if end else None,
                                                      None, 0, 1.0, 2.0, 3.0 if end else None)])
        stopped += ids_stopped
        for out in outs:
            texts.append(out.new_text)
            last = out
        if ids_stopped:
            break
    return "".join(texts), last, stopped


def generated(tok):
    """Text tokens with the eos token (a special token) in the middle, as under ignore_eos."""
    return tok.encode("ab") + [tok.eos_token_id] + tok.encode("cd")


@pytest.mark.parametrize("final_only", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_text_follows_the_requests_flag(tok, skip, final_only):
    ids = generated(tok)
    text, last, _ = run(tok, ids, StoppingParams(max_tokens=None, skip_special_tokens=skip),
                        final_only)
    want = tok.decode(ids, skip_special_tokens=skip)
    assert ("</s>" in want) is not skip
    assert (last.new_text if final_only else text) == want


def test_a_stop_string_of_special_token_text_matches_only_when_kept(tok):
    ids = generated(tok)
    kept, last, stopped = run(tok, ids, StoppingParams(max_tokens=None, stop=["</s>"],
                                                       skip_special_tokens=False))
    assert stopped == ["r"] and last.stop_reason == "</s>"
    assert kept == tok.decode(ids, skip_special_tokens=False).split("</s>")[0]
    skipped, _, stopped = run(tok, ids, StoppingParams(max_tokens=None, stop=["</s>"]))
    assert stopped == [] and skipped == tok.decode(ids)


def test_two_requests_of_one_processor_keep_their_own_flag(tok):
    proc = OutputProcessor(tok)
    ids = generated(tok)
    for rid, skip in (("keep", False), ("skip", True)):
        proc.add_request(Request(rid, tok.encode("Q:"), SamplingParams(),
                                 StoppingParams(max_tokens=None, skip_special_tokens=skip)))
    texts = {"keep": "", "skip": ""}
    for i, t in enumerate(ids):
        end = i == len(ids) - 1
        outs, _ = proc.process([TokenUpdate(rid, [t], [], None, LEN if end else None, None, 0,
                                            1.0, 2.0, 3.0 if end else None)
                                for rid in texts])
        for out in outs:
            texts[out.request_id] += out.new_text
    assert texts == {"keep": tok.decode(ids, skip_special_tokens=False),
                     "skip": tok.decode(ids, skip_special_tokens=True)}


@pytest.mark.parametrize("field", ["skip_special_tokens", "ignore_eos",
                                   "include_stop_str_in_output"])
def test_flags_must_be_booleans(field):
    with pytest.raises(ParamError) as e:
        StoppingParams(**{field: "false"})
    assert e.value.field == field and "true or false" in str(e.value)
