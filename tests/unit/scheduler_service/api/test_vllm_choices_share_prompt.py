"""The n choices of one VllmEngine Generate share one prompt list: a copy per choice cost
n=1024 choices of a 100k-token prompt ~0.8 GB and ~0.5 s of the event loop before the first
was queued (the choices' requests are built on the loop)."""
from __future__ import annotations

from tests.support.vllm_sim import generate

# `server` and `stub`: conftest.py (a fresh SimServer per test)


def test_the_choices_share_the_prompt(server, stub, monkeypatch):
    engine, prompts = server.engine, []
    original = engine.generate

    def recording(request):
        prompts.append(request.prompt_token_ids)
        return original(request)
    monkeypatch.setattr(engine, "generate", recording)
    msgs = list(stub.Generate(generate(request_id="n4", n=4, seed=1, temperature=1.0,
                                       max_tokens=2, ignore_eos=True), timeout=30))
    assert sorted(m.complete.index for m in msgs) == [0, 1, 2, 3]
    assert len(prompts) == 4 and all(p is prompts[0] for p in prompts)
