"""Tensor-parallel layouts give exactly the TP=1 tokens, greedy and seeded sampling, and the
scheduler's diff bytes do not depend on the TP size.

Real processes on loopback, gloo on CPU: worker services started with --local-ranks/--node-rank/
--nodes (each spawning its rank processes), driven by a scheduler-side EngineCore through
WorkerClient; the reference is the in-process TP=1 engine (deltaserve.llm.LLM) with the same
scheduler settings and block count.
"""
from __future__ import annotations


import pytest

from tests.support.tp_harness import (NUM_BLOCKS, Cluster, RecordingExecutor, make_core, reference,
                                      run_requests)
from tests.support.tp_harness import workload

# name -> (nodes, local ranks). TP=4 splits 4 query heads 1 per rank and replicates 2 KV heads.
LAYOUTS = {"tp2_local": (1, 2), "tp2_nodes": (2, 1), "tp4_2x2": (2, 2)}
# name -> (arch, config overrides); 4 heads and 2 KV heads, or 1 KV head (fewer than ranks).
MODELS = {"qwen3": ("qwen3", {}), "llama": ("llama", {}),
          "llama_kv1": ("llama", {"num_key_value_heads": 1})}




@pytest.fixture(scope="module")
def model_dirs(tiny_models):
    return {name: tiny_models(arch, **overrides) for name, (arch, overrides) in MODELS.items()}


@pytest.fixture(scope="module")
def references(model_dirs):
    """TP=1 tokens and diff payloads per model, computed once."""
    return {name: reference(path, *workload()) for name, path in model_dirs.items()}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request, tmp_path_factory):
    nodes, local_ranks = LAYOUTS[request.param]
    c = Cluster.start(tmp_path_factory.mktemp(request.param), nodes=nodes,
                      local_ranks=local_ranks)
    yield c
    c.close()


@pytest.mark.parametrize("model_name", list(MODELS))
def test_layout_matches_tp1(cluster, model_name, model_dirs, references):
    model = model_dirs[model_name]
    tp_size = cluster.tp_size
    client = cluster.client(init_timeout_s=120.0, step_timeout_s=60.0)
    try:
        # Symmetry checks on for the llama models: also proves the ranks stay in step.
        result = client.init(cluster.spec(model, verify_symmetry=model_name != "qwen3"))
        assert result.tp_size == tp_size, cluster.logs()
        assert [d.global_rank for d in result.devices] == list(range(tp_size))
        assert result.num_kv_blocks >= NUM_BLOCKS
        recorder = RecordingExecutor(client)
        tokens = run_requests(make_core(model, recorder), model, *workload())
    except Exception:
        print(cluster.logs())
        raise
    finally:
        client.close()
    expected_tokens, expected_payloads = references[model_name]
    assert tokens == expected_tokens
    # The same schedule encodes to the same bytes at TP=1 and TP=N: sent once per node.
    assert recorder.payloads == expected_payloads
    # A new Init (another model, a new epoch) keeps the rank processes and their group.
    pids = [node.rank_pids() for node in cluster.nodes]
    assert all(len(p) == cluster.local_ranks for p in pids)
    if cluster.kept_pids is not None:
        assert pids == cluster.kept_pids
    cluster.kept_pids = pids
