"""Our paged-cache decoder against transformers on the same tiny random weights (float32).

Each scenario feeds tokens through the paged KV cache in steps (whole prompt, chunks, single
token decodes, several requests batched together) and compares every scheduled position's
logits with transformers' logits for the full sequence.
"""
from __future__ import annotations

import pytest
import torch

from worker_service.models.tiny_model import make_tiny_model
from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import TorchAttentionBackend
from worker_service.layers.rotary import RopeSettings, compute_inv_freq
from worker_service.models.loader import allocate_kv_caches, load_model
from worker_service.parallel_state import single_rank_group

ARCHS = ("qwen3", "llama", "qwen2")
BLOCK_SIZE = 4
NUM_BLOCKS = 64
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (our model, transformers model), both float32 on CPU."""
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in ARCHS:
        path = make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=1)
        ours = load_model(path, single_rank_group(), TorchAttentionBackend(), "cpu")
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[arch] = (ours, theirs)
    return out


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


class PagedRunner:
    """Drives our model step by step, like a model runner would, with random block tables."""

    def __init__(self, model, seqs: list[torch.Tensor], seed: int) -> None:
        self.model = model
        self.seqs = seqs
        self.done = [0] * len(seqs)                       # tokens already in the KV cache
        self.caches = allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE, "cpu")
        gen = torch.Generator().manual_seed(seed)
        blocks = torch.randperm(NUM_BLOCKS, generator=gen).to(torch.int32)
        per_req = NUM_BLOCKS // len(seqs)
        self.block_table = blocks[:per_req * len(seqs)].view(len(seqs), per_req)

    def step(self, num_new: list[int], num_pad: int = 0) -> list[torch.Tensor]:
        """Schedule num_new[i] tokens of request i; returns each request's logits rows."""
        ids, pos, slots, starts, seq_lens = [], [], [], [0], []
        for i, n in enumerate(num_new):
            p = torch.arange(self.done[i], self.done[i] + n)
            ids.append(self.seqs[i][p])
            pos.append(p)
            slots.append(self.block_table[i, p // BLOCK_SIZE].long() * BLOCK_SIZE
                         + p % BLOCK_SIZE)
            starts.append(starts[-1] + n)
            seq_lens.append(self.done[i] + n)
            self.done[i] += n
        ids.append(torch.zeros(num_pad, dtype=torch.long))       # padding rows
        pos.append(torch.zeros(num_pad, dtype=torch.long))
        slots.append(torch.full((num_pad,), -1, dtype=torch.long))
        qsl = torch.tensor(starts, dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            num_reqs=len(num_new), num_actual_tokens=starts[-1], max_query_len=max(num_new),
            max_seq_len=max(seq_lens), query_start_loc=qsl, seq_lens=lens,
            block_table=self.block_table, slot_mapping=torch.cat(slots),
            query_start_loc_cpu=qsl.clone(), seq_lens_cpu=lens.clone())
        with torch.no_grad():
            hidden = self.model(torch.cat(ids), torch.cat(pos), self.caches, meta)
            logits = self.model.compute_logits(hidden[:starts[-1]])
        return [logits[starts[i]:starts[i + 1]] for i in range(len(num_new))]


def random_ids(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_full_prefill_matches(models, arch):
    ours, theirs = models[arch]
    ids = random_ids(37, seed=1)
    (logits,) = PagedRunner(ours, [ids], seed=0).step([37])
    torch.testing.assert_close(logits, hf_logits(theirs, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_then_decodes_match(models, arch):
    ours, theirs = models[arch]
    ids = random_ids(30, seed=2)
    expected = hf_logits(theirs, ids)
    runner = PagedRunner(ours, [ids], seed=1)
    schedule = [11, 16, 1, 1, 1]          # first chunk, the rest of the prompt, three decodes
    done = 0
    for n in schedule:
        (logits,) = runner.step([n])
        done += n
        torch.testing.assert_close(logits[-1], expected[done - 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits, expected[done - n:done], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_mixed_steps_with_padding_match(models, arch):
    """Three requests sharing steps: prefills, chunks and decodes mixed, padded rows at the end."""
    ours, theirs = models[arch]
    seqs = [random_ids(n, seed=10 + n) for n in (21, 9, 14)]
    expected = [hf_logits(theirs, s) for s in seqs]
    runner = PagedRunner(ours, seqs, seed=2)
    schedule = [[8, 9, 5], [13, 0, 7], [0, 0, 2]]
    for step, num_new in enumerate(schedule):
        before = list(runner.done)
        outs = runner.step(num_new, num_pad=3 if step == 0 else 0)
        for i, n in enumerate(num_new):
            torch.testing.assert_close(outs[i], expected[i][before[i]:before[i] + n],
                                       atol=ATOL, rtol=0)


def test_llama3_rope_scaling_is_applied(models):
    ours, _ = models["llama"]
    rope = ours.model.layers[0].self_attn.rotary_emb
    plain = compute_inv_freq(16, RopeSettings(theta=10000.0))
    # positions 1: angle = inv_freq; scaled low frequencies are 8x slower than the plain ones.
    scaled = torch.atan2(rope.sin_cache[1, :8], rope.cos_cache[1, :8])
    torch.testing.assert_close(scaled[:3], plain[:3])
    torch.testing.assert_close(scaled[4:], plain[4:] / 8)


def test_rope_settings_read_both_config_layouts():
    legacy = {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 256}}
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 256}}
    assert RopeSettings.from_hf_config(legacy) == RopeSettings.from_hf_config(new)
    assert RopeSettings.from_hf_config({}).rope_type == "default"
    with pytest.raises(ValueError, match="rope_type='proportional' is not supported: must be "
                                         "one of .*'yarn', 'dynamic'"):
        RopeSettings.from_hf_config({"rope_parameters": {"rope_type": "proportional",
                                                         "factor": 4.0}})
