"""The streamed text on the real default model's tokenizer (SmolLM2-135M-Instruct, byte-level
BPE, 49152 ids): every step's text equals vLLM v1's (tokenizers' DecodeStream stepped, as
tests/support/vllm_text.py models it), and the whole text equals transformers' decode of the
same ids where that ends in a whole character. No weights are loaded."""
from __future__ import annotations

import random

import pytest

from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_result import TokenUpdate
from scheduler_service.engine.output_processor import OutputProcessor
from tests.support.vllm_text import VllmTextModel

pytestmark = pytest.mark.slow
LEN, STOP_TOK, STOP_STR = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOP_TOKEN,
                           RequestStatus.FINISHED_STOP_STRING)
TEXTS = ["The capital of France is Paris.", "naïve café — déjà vu", "你好，世界！🙂🦊",
         "Ελληνικά κείμενα", "x = [1, 2, 3]\nprint(x)", "<|im_start|>user\nHi<|im_end|>"]


@pytest.fixture(scope="module")
def toks(default_model):
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(default_model), AutoTokenizer.from_pretrained(default_model)


def random_ids(rng, tok) -> list[int]:
    """Pieces of real texts, cut anywhere (even inside a character: byte-level tokens of
    a character), ids drawn from the whole vocabulary, special tokens."""
    ids: list[int] = []
    while len(ids) < rng.randrange(1, 40):
        r = rng.random()
        if r < 0.6:
            enc = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
            a = rng.randrange(len(enc))
            ids += enc[a:a + rng.randrange(1, 8)]
        elif r < 0.9:
            ids.append(rng.randrange(tok.vocab_size))
        else:
            ids.append(rng.choice([0, 1, 2]))       # <|endoftext|>, <|im_start|>, <|im_end|>
    return ids


def stream(tok, prompt, ids, chunk, finish, stopping):
    req = Request("r", prompt, SamplingParams(), stopping)
    model = VllmTextModel(tok, prompt, list(stopping.stop), stopping.include_stop_str_in_output,
                          stopping.min_tokens)
    proc = OutputProcessor(tok)
    proc.add_request(req)
    ours, theirs, matched = [], [], None
    chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    for n, part in enumerate(chunks):
        last = n == len(chunks) - 1
        reason = finish if last else None
        got, _ = proc.process([TokenUpdate("r", part, [-1.0] * len(part), None, reason,
                                           part[-1] if reason == STOP_TOK else None, 0, None,
                                           None, None)])
        ours += [o.new_text for o in got]
        matched = model.update(part, reason == STOP_TOK)
        theirs.append(model.delta(last or matched is not None))
        if matched is not None:
            assert got[-1].finish_reason == STOP_STR and got[-1].stop_reason == matched
            break
    return ours, theirs, matched


def test_streamed_text_is_vllms_step_by_step(toks):
    tok, hf = toks
    rng = random.Random(2026)
    prompt = tok.encode(hf.apply_chat_template([{"role": "user", "content": "Hi"}],
                                               add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    unfinished = 0
    for trial in range(200):
        ids = random_ids(rng, tok)
        chunk = 1 if rng.random() < 0.7 else rng.randrange(2, 5)
        stops = [] if rng.random() < 0.3 else [
            rng.choice(TEXTS)[a:a + rng.randrange(1, 6)]
            for a in [rng.randrange(10) for _ in range(1 if chunk > 1 else rng.randrange(1, 3))]]
        stops = [s for s in stops if s]
        stopping = StoppingParams(max_tokens=None, stop=stops,
                                  include_stop_str_in_output=rng.random() < 0.5,
                                  min_tokens=rng.choice([0, 0, 3]))
        finish = LEN if rng.random() < 0.7 else STOP_TOK
        ours, theirs, matched = stream(tok, prompt, ids, chunk, finish, stopping)
        assert ours == theirs, (trial, ids, stops, chunk, finish)
        if matched is None and finish == LEN:
            # transformers' decode, less a character the ids leave unfinished
            full = hf.decode(ids, skip_special_tokens=True)
            unfinished += full.endswith("\ufffd")
            if not full.endswith("\ufffd"):
                assert "".join(ours) == full, (trial, ids)
    assert unfinished > 0        # the case the stream must not end in U+FFFD was met


def test_generation_cut_inside_a_character_ends_at_the_last_whole_one(toks):
    """" 🦊" is "ĠðŁ" (a space and two of the emoji's four bytes), "¦", "Ĭ": cut before the
    last, transformers' decode ends in U+FFFD; vLLM's text (and ours) ends after "Paris", the
    space going with the token that holds it, whose text never became whole."""
    tok, hf = toks
    ids = tok.encode("Paris 🦊", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["Paris", "ĠðŁ", "¦", "Ĭ"]
    assert hf.decode(ids[:3]) == "Paris \ufffd"
    for cut in (2, 3):
        ours, theirs, _ = stream(tok, tok.encode("Q:"), ids[:cut], 1, LEN,
                                 StoppingParams(max_tokens=None))
        assert "".join(ours) == "".join(theirs) == "Paris"
    ours, theirs, _ = stream(tok, tok.encode("Q:"), ids, 1, LEN, StoppingParams(max_tokens=None))
    assert ours == theirs == ["Paris", "", "", " 🦊"]
