"""TopLogprob.text on worker threads: GenerationServicer._token_text (one id decoded alone by the
HF tokenizer) runs in asyncio.to_thread when an output is built off the event loop (over
OFF_LOOP_TOKENS tokens: a lagging consumer's pile; prompt logprobs), several such outputs at once,
while the loop's output processor detokenizes other requests on the same Tokenizer (and fills
its shared cache of single-token texts, Tokenizer.token_texts).

Where it runs: generation_servicer.Generate -> asyncio.to_thread(output_to_proto, out,
self._token_text, ...) -> convert._add_top_logprobs -> _token_text per alternative. Nothing of
it keeps per-request state: tokenizers' decode reads the tokenizer (Rust `&self`, Sync) and
returns a new string. Shown here with the tokenizers the project serves (the real default model,
SmolLM2's byte-level BPE, and the tiny models' own): many threads building long outputs' messages
at once, beside threads detokenizing, give exactly the single-thread results."""
from __future__ import annotations

import random
import threading

import pytest

from engine_common.model_files.model_dir import ModelInfo
from engine_common.text.tokenizer import IncrementalDetokenizer, Tokenizer
from scheduler_service.api.convert import OFF_LOOP_TOKENS, builds_off_loop, output_to_proto
from scheduler_service.api.front_door import ServedModel
from scheduler_service.api.generation_servicer import GenerationServicer
from scheduler_service.engine.request_output import RequestOutput, RequestTimings, TokenLogprob

NUM_BUILDERS = 12          # threads building messages
NUM_DETOKENIZERS = 4       # threads detokenizing meanwhile
NUM_OUTPUTS = 12
NUM_TOKENS = OFF_LOOP_TOKENS + 72
NUM_TOP = 20               # --max-logprobs' default


@pytest.fixture(params=["smollm2", "tiny"])
def model_dir(request, tiny_models) -> str:
    if request.param == "smollm2":
        return request.getfixturevalue("default_model")
    return tiny_models("qwen3")


def _output(rng: random.Random, vocab: int, i: int) -> RequestOutput:
    """A long output with NUM_TOP alternatives per token, ids across the whole vocabulary
    (special tokens, and pieces of multi-byte characters, among them)."""
    ids = [rng.randrange(vocab) for _ in range(NUM_TOKENS)]
    logprobs = [TokenLogprob(t, -0.5, [rng.randrange(vocab) for _ in range(NUM_TOP)],
                             [-float(k) for k in range(NUM_TOP)]) for t in ids]
    return RequestOutput(f"r{i}", ids, "", logprobs, False, None, None, 3, NUM_TOKENS, 0,
                         RequestTimings(0.0, None, None))


def _detokenized(tokenizer: Tokenizer, ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer, ids[:8])
    return "".join(detok.add(t) for t in ids[8:])


def test_messages_built_on_many_threads_equal_the_single_thread_ones(model_dir):
    info = ModelInfo.from_dir(model_dir)
    served = ServedModel(info, Tokenizer.from_dir(model_dir), block_size=16)
    servicer = GenerationServicer(None, served)
    vocab = served.tokenizer.backend.get_vocab_size(with_added_tokens=True)
    rng = random.Random(41)
    outputs = [_output(rng, vocab, i) for i in range(NUM_OUTPUTS)]
    assert all(builds_off_loop(out) for out in outputs)
    texts = [[rng.randrange(vocab) for _ in range(2000)] for _ in range(NUM_DETOKENIZERS)]
    # The references on one thread, with a tokenizer of their own: the shared one's cache of
    # single-token texts starts empty and is filled by the racing threads below.
    reference = Tokenizer.from_dir(model_dir)
    expected = [output_to_proto(out, lambda t: reference.decode([t], skip_special_tokens=False))
                .SerializeToString() for out in outputs]
    expected_texts = [_detokenized(reference, ids) for ids in texts]

    start = threading.Barrier(NUM_BUILDERS + NUM_DETOKENIZERS)
    built: dict[tuple[int, int], bytes] = {}
    detokenized: dict[int, str] = {}
    errors: list[BaseException] = []

    def build(worker: int) -> None:
        start.wait()
        for k in range(NUM_OUTPUTS):       # each thread in its own order
            i = (k + worker) % NUM_OUTPUTS
            built[worker, i] = output_to_proto(outputs[i], servicer._token_text) \
                .SerializeToString()

    def detokenize(j: int) -> None:
        start.wait()
        detokenized[j] = _detokenized(served.tokenizer, texts[j])

    def guarded(fn, arg):
        try:
            fn(arg)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
            start.abort()

    threads = ([threading.Thread(target=guarded, args=(build, w)) for w in range(NUM_BUILDERS)]
               + [threading.Thread(target=guarded, args=(detokenize, j))
                  for j in range(NUM_DETOKENIZERS)])
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(built) == NUM_BUILDERS * NUM_OUTPUTS
    for (worker, i), message in built.items():
        assert message == expected[i], (worker, i)
    assert [detokenized[j] for j in range(NUM_DETOKENIZERS)] == expected_texts
    # The messages do carry texts (each alternative's), the same as decode gives alone.
    sample = output_to_proto(outputs[0], servicer._token_text).logprobs[0].top_logprobs[0]
    assert sample.text == reference.decode([sample.token_id], skip_special_tokens=False)
    assert sum(bool(t.text) for t in output_to_proto(outputs[0], servicer._token_text)
               .logprobs[0].top_logprobs) > NUM_TOP // 2
