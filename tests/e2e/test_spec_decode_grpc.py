"""--speculative-config over real processes: a scheduler and a separate worker, with sync and
with async scheduling (drafts over the step in flight); concurrent greedy streams with drafts
give the tokens of the in-process engine without speculation, every block comes back, the
counters agree with each other, and a bad config is refused naming the key."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.grpc_harness import (Processes, child_env, collect, free_port,
                                        generation_stub, greedy_request, server_status,
                                        wait_for, wait_ready)
from tests.support.metrics_scrape import scrape
from tests.support.paths import REPO

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1})
PROMPTS = [[5, 17, 99, 42, 7] * 6, [200] * 7, [3, 4, 5, 6] * 5, list(range(40, 90)),
           [9, 8, 7, 9, 8, 7, 100, 101]]
MAX_NEW = 20


@pytest.fixture(scope="module", params=["sync", "async"])
def target(request, tiny_models, tmp_path_factory):
    procs = Processes(tmp_path_factory.mktemp("spec_grpc"))
    mode = ["--async-scheduling"] if request.param == "async" else []
    try:
        w_port, s_port, m_port = free_port(), free_port(), free_port()
        worker = procs.worker(w_port)
        sched = procs.scheduler(tiny_models("qwen3"), [w_port], s_port,
                                "--speculative-config", SPEC, "--max-num-seqs", "4",
                                "--max-num-batched-tokens", "32",
                                "--metrics-listen", f"127.0.0.1:{m_port}", *mode)
        target = f"127.0.0.1:{s_port}"
        wait_ready(target, [worker, sched])
        yield target, m_port, request.param
    finally:
        procs.close()


def _one(target: str, i: int) -> list[int]:
    with grpc.insecure_channel(target) as ch:
        ids, _, _ = collect(generation_stub(ch).Generate(
            greedy_request(PROMPTS[i], MAX_NEW, f"s{i}"), timeout=120))
    return ids


def test_streams_equal_the_engine_without_speculation(target, tiny_models):
    target, metrics_port, mode = target
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda i: _one(target, i), range(len(PROMPTS))))
    llm = LLM(tiny_models("qwen3"), dtype="float32", num_kv_blocks=128)
    want = llm.generate(PROMPTS, SamplingParams(),
                        StoppingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert got == [w.token_ids for w in want]
    wait_for(lambda: server_status(target).num_used_kv_blocks == 0, 10, "blocks freed")
    m = scrape(metrics_port)
    drafts = m.total("deltaserve:spec_decode_num_draft_tokens_total")
    accepted = m.total("deltaserve:spec_decode_num_accepted_tokens_total")
    assert m.total("deltaserve:spec_decode_num_drafts_total") > 0 and drafts > 0
    assert 0 < accepted <= drafts
    assert m.total("deltaserve:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    # Only async scheduling drafts over a step in flight, so only it can drop drafts.
    assert "deltaserve:spec_decode_num_dropped_drafts_total" in m.names
    if mode == "sync":
        assert m.total("deltaserve:spec_decode_num_dropped_drafts_total") == 0


@pytest.mark.parametrize("flags, key", [
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
     "speculative_config.num_speculative_tokens"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                              '"prompt_lookup_min": 9, "prompt_lookup_max": 3}'],
     "speculative_config.prompt_lookup_max"),
])
def test_bad_config_is_refused_naming_the_key(tiny_models, flags, key):
    cmd = [sys.executable, "-m", "deltaserve.cli", "scheduler", "--model", tiny_models("qwen3"),
           "--workers", f"127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{free_port()}",
           *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=child_env(None))
    assert done.returncode != 0
    assert key in done.stderr, done.stderr[-2000:]
