"""Sampler: greedy, seeded counter-based sampling, filters, penalties, stop masks, grammar
bitmasks, logprobs."""
import math

import numpy as np
import pytest
import torch

from worker_service.sample.grammar import bitmask_bias
from worker_service.sample.sampler import (Sampler, _mix32, apply_allowed_token_ids,
                                           apply_grammar_bias, apply_logit_bias,
                                           apply_penalties, apply_top_k, bitmask_to_bias,
                                           gumbel_noise, is_plain_greedy)
from worker_service.sample.sampling_metadata import SamplingMetadata, top_k_bound

NEUTRAL = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, counter=0,
               repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)


def make_meta(rows: list[dict], vocab: int, prompts=None, outputs=None, stop_masks=None,
              k: int = 0, device="cpu") -> SamplingMetadata:
    """Build metadata the way an InputBatch would: optional tensors only when a row uses them."""
    rows = [{**NEUTRAL, **r} for r in rows]

    def col(name, dtype, neutral):
        values = [r[name] for r in rows]
        if neutral is not None and all(v == neutral for v in values):
            return None
        return torch.tensor(values, dtype=dtype, device=device)

    def padded(seqs):
        if seqs is None:
            return None
        width = max(1, max(len(s) for s in seqs))
        return torch.tensor([list(s) + [vocab] * (width - len(s)) for s in seqs],
                            dtype=torch.int64, device=device)

    temps = [r["temperature"] for r in rows]
    pairs = [(row, tid) for row, ids in (stop_masks or {}).items() for tid in ids]
    stop_index = (torch.tensor(pairs, dtype=torch.int64, device=device).T.contiguous()
                  if pairs else None)
    return SamplingMetadata(
        temperature=col("temperature", torch.float32, None),
        all_greedy=all(t == 0 for t in temps), all_random=all(t > 0 for t in temps),
        top_p=col("top_p", torch.float32, 1.0), top_k=col("top_k", torch.int32, 0),
        min_p=col("min_p", torch.float32, 0.0),
        seeds=col("seed", torch.int64, None), counters=col("counter", torch.int64, None),
        repetition_penalty=col("repetition_penalty", torch.float32, 1.0),
        presence_penalty=col("presence_penalty", torch.float32, 0.0),
        frequency_penalty=col("frequency_penalty", torch.float32, 0.0),
        prompt_token_ids=padded(prompts), output_token_ids=padded(outputs),
        stop_mask_index=stop_index, max_num_logprobs=k,
        top_k_max=top_k_bound(np.array([r["top_k"] for r in rows]), vocab))


def sample(logits, rows, **kw):
    return Sampler().forward(logits, make_meta(rows, logits.shape[1], **kw))


def rand_logits(n, v, seed=0, scale=3.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def test_mixer_matches_python_ints():
    def ref(x):  # the same mixer on Python ints, with explicit 32-bit wrap-around
        x ^= x >> 16
        x = (x * 0x21F0AAAD) % 2**32
        x ^= x >> 15
        x = (x * 0x735A2D97) % 2**32
        return x ^ (x >> 15)
    g = torch.Generator().manual_seed(0)
    xs = torch.cat([torch.randint(0, 2**32, (1000,), generator=g, dtype=torch.int64),
                    torch.tensor([0, 1, 2**32 - 1, 2**31])])
    assert _mix32(xs).tolist() == [ref(x) for x in xs.tolist()]


def test_noise_is_deterministic_and_well_formed():
    seeds = torch.tensor([0, 1, 2**63 - 1, 12345])
    counters = torch.tensor([0, 0, 7, 2**40])
    a = gumbel_noise(seeds, counters, 5000)
    assert torch.equal(a, gumbel_noise(seeds, counters, 5000))
    assert torch.isfinite(a).all()
    # Row order does not matter; Gumbel(0,1) has mean ~0.5772 and variance pi^2/6.
    assert torch.equal(gumbel_noise(seeds.flip(0), counters.flip(0), 5000), a.flip(0))
    assert abs(a.mean().item() - 0.5772) < 0.05
    assert abs(a.var().item() - math.pi**2 / 6) < 0.1
    # Rows for neighbouring seeds / counters are uncorrelated (corr ~ N(0, 1/V)).
    for s, c in ((torch.arange(200), torch.zeros(200)), (torch.full((200,), 7), torch.arange(200))):
        corr = torch.corrcoef(gumbel_noise(s.long(), c.long(), 4096))
        off = corr[~torch.eye(200, dtype=torch.bool)]
        assert off.std().item() < 1.2 / 64 and off.abs().max().item() < 6 / 64


def test_greedy_is_argmax_with_raw_logprobs():
    logits = rand_logits(8, 50)
    out = sample(logits, [{}] * 8, k=5)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.sampled_token_ids[:, None])[:, 0],
                          atol=1e-5)
    values, ids = ref.topk(5, -1)
    assert torch.equal(out.top_ids, ids)
    assert torch.allclose(out.top_logprobs, values, atol=1e-5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


def test_top_k_one_is_greedy():
    logits = rand_logits(16, 64, seed=1)
    rows = [dict(temperature=1.5, top_k=1, seed=s) for s in range(16)]
    assert torch.equal(sample(logits, rows).sampled_token_ids, logits.argmax(-1))
    rows = [dict(r, top_p=0.9) for r in rows]  # the sort-based path
    assert torch.equal(sample(logits, rows).sampled_token_ids, logits.argmax(-1))


def test_same_seed_and_counter_same_token_in_any_batch():
    vocab = 200
    logits = rand_logits(6, vocab, seed=2, scale=1.0)
    target = dict(temperature=0.8, top_p=0.95, seed=123, counter=5)
    alone = sample(logits[3:4], [target]).sampled_token_ids.item()
    others = [dict(), dict(temperature=1.2, top_k=10, seed=9), dict(repetition_penalty=1.3),
              target, dict(temperature=0.5, min_p=0.1, seed=4, counter=99), dict()]
    batch = sample(logits, others, prompts=[[1, 2]] * 6, outputs=[[3], [], [4, 4], [], [5], []])
    assert batch.sampled_token_ids[3].item() == alone


def test_different_counters_and_seeds_give_different_draws():
    flat = torch.zeros(50, 1000)
    by_counter = sample(flat, [dict(temperature=1.0, seed=7, counter=c) for c in range(50)])
    by_seed = sample(flat, [dict(temperature=1.0, seed=s, counter=3) for s in range(50)])
    assert len(set(by_counter.sampled_token_ids.tolist())) > 40
    assert len(set(by_seed.sampled_token_ids.tolist())) > 40


@pytest.mark.parametrize("vary", ["seed", "counter"])
def test_frequencies_match_softmax(vary):
    n, temp = 8000, 0.7
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]]).repeat(n, 1)
    rows = [dict(temperature=temp, seed=i if vary == "seed" else 42,
                 counter=i if vary == "counter" else 0) for i in range(n)]
    tokens = sample(logits, rows).sampled_token_ids
    freq = torch.bincount(tokens, minlength=6).double() / n
    p = torch.softmax(logits[0].double() / temp, -1)
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma).all(), (freq, p)


def _draw(logits_row, n, **params):
    logits = logits_row.repeat(n, 1)
    return set(sample(logits, [dict(params, seed=s) for s in range(n)])
               .sampled_token_ids.tolist())


def test_filters_never_pick_excluded_tokens():
    row = rand_logits(1, 20, seed=3, scale=1.0)
    probs = torch.softmax(row[0], -1)
    order = probs.argsort(descending=True).tolist()
    # top-k: exactly the k best (and all of them show up with a flat-ish distribution).
    assert _draw(row, 2000, temperature=1.0, top_k=5) == set(order[:5])
    # top-p: the smallest set of best tokens whose mass reaches p.
    cum, nucleus = 0.0, set()
    for t in order:
        nucleus.add(t)
        cum += probs[t].item()
        if cum >= 0.6:
            break
    assert _draw(row, 2000, temperature=1.0, top_p=0.6) <= nucleus
    assert _draw(row, 2000, temperature=1.0, top_p=0.6, top_k=2) <= nucleus & set(order[:2])
    # min-p: p >= min_p * p_max.
    allowed = {t for t in range(20) if probs[t] >= 0.3 * probs.max()}
    assert _draw(row, 2000, temperature=1.0, min_p=0.3) <= allowed


def test_min_p_filters_before_top_p_as_vllm():
    """vLLM applies min_p (an argmax-invariant logits processor) after the temperature and
    before top-k / top-p, so top-p measures the mass of the min-p survivors: with p = (.5, .3,
    .1, .05, .05), min_p .15 drops the two .05 tokens, and top-p .85 over the renormalized
    (.56, .33, .11) then drops the .1 token too (its ascending mass .11 <= .15)."""
    row = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]]))
    assert _draw(row, 2000, temperature=1.0, min_p=0.15, top_p=0.85) == {0, 1}
    assert _draw(row, 2000, temperature=1.0, min_p=0.15, top_k=4, top_p=0.85) == {0, 1}


def _reference_penalties(logits, prompts, outputs, rep, pres, freq):
    out = logits.clone()
    for i in range(out.shape[0]):
        for t in set(prompts[i]) | set(outputs[i]):
            out[i, t] = out[i, t] / rep[i] if out[i, t] > 0 else out[i, t] * rep[i]
        for t in set(outputs[i]):
            out[i, t] -= freq[i] * outputs[i].count(t) + pres[i]
    return out


def test_penalties_match_reference():
    logits = rand_logits(3, 30, seed=4)
    prompts, outputs = [[1, 2, 2, 5], [], [7]], [[2, 3, 3, 3], [9, 9], []]
    rep, pres, freq = [1.5, 1.0, 0.7], [0.5, -0.3, 1.0], [0.2, 0.4, -1.0]
    rows = [dict(repetition_penalty=r, presence_penalty=p, frequency_penalty=f)
            for r, p, f in zip(rep, pres, freq)]
    meta = make_meta(rows, 30, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, meta)
    assert torch.allclose(got, _reference_penalties(logits, prompts, outputs, rep, pres, freq))
    # The sampler applies them before greedy argmax; logprobs stay raw.
    out = Sampler().forward(logits, meta)
    assert torch.equal(out.sampled_token_ids, got.argmax(-1))
    raw = torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None])[:, 0]
    assert torch.allclose(out.logprobs, raw, atol=1e-5)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    meta = make_meta([dict(repetition_penalty=1.2)], 3, prompts=[[0]], outputs=[[]])
    assert Sampler().forward(logits, meta).sampled_token_ids.item() == 1


def test_stop_masks_enforced():
    logits = rand_logits(4, 40, seed=5)
    best = logits.argmax(-1)
    masks = {0: [best[0].item()], 2: [best[2].item(), 3]}
    rows = [dict(), dict(), dict(temperature=1.0, top_k=1, seed=1), dict(temperature=1.0)]
    out = sample(logits, rows, stop_masks=masks)
    second = logits.clone()
    second[0, best[0]] = second[2, best[2]] = second[2, 3] = float("-inf")
    assert torch.equal(out.sampled_token_ids[:3], second.argmax(-1)[:3])
    assert out.sampled_token_ids[1] == best[1]
    # Random rows never draw a masked id.
    many = sample(logits[2:3].repeat(500, 1), [dict(temperature=2.0, seed=s) for s in range(500)],
                  stop_masks={r: masks[2] for r in range(500)})
    assert not set(many.sampled_token_ids.tolist()) & set(masks[2])


def test_logprobs_are_raw_for_random_rows():
    logits = rand_logits(5, 30, seed=6)
    rows = [dict(temperature=0.5, top_k=3, seed=s, repetition_penalty=1.3) for s in range(5)]
    out = sample(logits, rows, prompts=[[1]] * 5, outputs=[[2]] * 5, k=3)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.sampled_token_ids[:, None])[:, 0],
                          atol=1e-5)
    assert torch.allclose(out.top_logprobs, ref.topk(3, -1).values, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_equal_cpu_draws():
    logits = rand_logits(32, 5000, seed=8, scale=1.0)
    rows = [dict(temperature=0.9, top_p=0.9, top_k=50, seed=s * 7919, counter=s) for s in range(32)]
    cpu = sample(logits, rows)
    gpu = Sampler().forward(logits.cuda(), make_meta(rows, 5000, device="cuda"))
    seeds, counters = torch.arange(32) * 7919, torch.arange(32)
    bits_cpu = gumbel_noise(seeds, counters, 5000)
    bits_gpu = gumbel_noise(seeds.cuda(), counters.cuda(), 5000).cpu()
    assert torch.allclose(bits_cpu, bits_gpu, rtol=0, atol=1e-6)
    assert torch.equal(cpu.sampled_token_ids, gpu.sampled_token_ids.cpu())


def test_worst_case_metadata_runs_every_feature():
    """The KV profiler samples with this to budget the sampler's temporaries."""
    from worker_service.sample.sampling_metadata import worst_case_sampling_metadata

    meta = worst_case_sampling_metadata(4, 64, "cpu")
    assert meta.has_penalties and meta.top_k is not None and meta.top_p is not None
    out = Sampler().forward(torch.randn(4, 64), meta)
    assert out.sampled_token_ids.shape == (4,) and out.top_ids.shape == (4, 20)
    assert set(meta.id_sets) == {"allowed_token_ids"}
    assert out.sampled_token_ids.tolist() == [1] * 4          # the one allowed id


def test_top_k_bound_and_apply_top_k_with_a_loose_bound():
    """The host-known bound is the largest active k (0 and >= vocab are off); any bound at
    least that large gives the same filter, and top_k without a bound is rejected."""
    assert top_k_bound(np.array([0, 3, 7, 64, 100]), 64) == 7
    assert top_k_bound(np.array([0, 0]), 64) == 1
    x = rand_logits(6, 64, seed=9)
    top_k = torch.tensor([0, 1, 3, 7, 64, 5], dtype=torch.int32)
    exact = apply_top_k(x, top_k, 7)
    assert torch.equal(exact, apply_top_k(x, top_k, 50))
    assert torch.equal(exact, apply_top_k(x, top_k, 1000))
    kept = torch.isfinite(exact).sum(-1).tolist()
    assert kept == [64, 1, 3, 7, 64, 5]
    with pytest.raises(ValueError, match="top_k_max=0"):
        SamplingMetadata(temperature=torch.ones(1), all_greedy=False, all_random=True,
                         top_p=None, top_k=torch.ones(1, dtype=torch.int32), min_p=None,
                         seeds=torch.zeros(1, dtype=torch.int64),
                         counters=torch.zeros(1, dtype=torch.int64), repetition_penalty=None,
                         presence_penalty=None, frequency_penalty=None, prompt_token_ids=None,
                         output_token_ids=None)


def _bitmask(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """int32 [K, ceil(V / 32)] with bit t % 32 of word t // 32 set for every allowed id."""
    bits = np.zeros((len(allowed), -(-vocab // 32) * 32), dtype=np.uint8)
    for i, ids in enumerate(allowed):
        bits[i, list(ids)] = 1
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


def test_bitmask_bias_on_host_and_device_agree_and_mask_only_the_listed_rows():
    vocab = 70                                  # not a multiple of 32: the tail words are cut
    x = rand_logits(4, vocab, seed=3)
    before = x.clone()
    allowed = [{0, 31, 32, 69}, {5}]
    bitmask = _bitmask(allowed, vocab)
    bias = bitmask_to_bias(bitmask, vocab)
    assert torch.equal(bias, torch.from_numpy(bitmask_bias(bitmask.numpy(), vocab)))
    out = apply_grammar_bias(x, torch.tensor([1, 3]), bias)
    assert torch.equal(x, before)               # out of place
    assert torch.equal(out[[0, 2]], x[[0, 2]])
    for row, ids in zip((1, 3), allowed):
        finite = set(torch.nonzero(torch.isfinite(out[row])).flatten().tolist())
        assert finite == ids
        assert torch.equal(out[row, sorted(ids)], x[row, sorted(ids)])   # exact values
    every = apply_grammar_bias(x[:2], None, bias)
    assert torch.equal(every, apply_grammar_bias(x[:2], torch.tensor([0, 1]), bias))
    assert apply_grammar_bias(x, None, None) is x


def test_grammar_masks_bind_greedy_and_random_rows_and_logprobs_stay_raw():
    vocab = 100
    logits = rand_logits(3, vocab, seed=4)
    rows = [dict(), dict(temperature=1.0, seed=9), dict(temperature=0.7, seed=2)]
    allowed = [{17}, {3, 50, 99}]
    meta = make_meta(rows, vocab)
    meta.grammar_rows = torch.tensor([0, 1])
    meta.grammar_bias = bitmask_to_bias(_bitmask(allowed, vocab), vocab)
    for _ in range(3):
        out = Sampler().forward(logits, meta)
        assert out.sampled_token_ids[0] == 17 and out.sampled_token_ids[1].item() in allowed[1]
    free = Sampler().forward(logits, make_meta(rows, vocab))
    assert out.sampled_token_ids[2] == free.sampled_token_ids[2]      # untouched row
    raw = torch.log_softmax(logits, dim=-1)
    ids = out.sampled_token_ids
    assert torch.allclose(out.logprobs, raw[torch.arange(3), ids])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grammar_bias_equals_the_host_bias():
    vocab = 1000
    rng = np.random.default_rng(3)
    bitmask = torch.from_numpy(rng.integers(-2**31, 2**31, (8, -(-vocab // 32)),
                                            dtype=np.int64).astype(np.int32))
    gpu = bitmask_to_bias(bitmask.cuda(), vocab).cpu()
    assert torch.equal(gpu, torch.from_numpy(bitmask_bias(bitmask.numpy(), vocab)))


def test_logit_bias_moves_greedy_and_random_rows_and_logprobs_stay_raw():
    """OpenAI's logit_bias: -100 bans the argmax, +100 forces a token; added before the other
    steps, on greedy and random rows alike; the logprobs are still the raw model's."""
    logits = rand_logits(3, 40, seed=9)
    best = logits.argmax(-1)
    forced = (best[1].item() + 1) % 40
    pairs = [(0, best[0].item(), -100.0), (1, forced, 100.0), (2, 7, 100.0)]
    meta = make_meta([dict(), dict(), dict(temperature=1.0, seed=3)], 40)
    meta.logit_bias_index = torch.tensor([[r, t] for r, t, _ in pairs]).T.contiguous()
    meta.logit_bias_values = torch.tensor([b for _, _, b in pairs], dtype=torch.float32)
    assert not is_plain_greedy(meta)
    out = Sampler().forward(logits, meta)
    biased = logits.clone()
    biased[0, best[0]] -= 100.0
    assert out.sampled_token_ids[0] == biased[0].argmax() != best[0]
    assert out.sampled_token_ids[1:].tolist() == [forced, 7]
    raw = torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, raw)
    assert torch.equal(apply_logit_bias(logits, None, None), logits)


def test_allowed_token_ids_bind_only_their_rows_and_logprobs_stay_raw():
    logits = rand_logits(3, 64, seed=5)
    allowed = {0: [3, 40], 2: [11]}                 # row 1 is not restricted
    pairs = [(row, t) for row, ids in allowed.items() for t in ids]
    index = torch.tensor(pairs, dtype=torch.int64).T.contiguous()
    masked = apply_allowed_token_ids(logits, index)
    assert torch.isinf(masked[0]).sum() == 62 and torch.equal(masked[1], logits[1])
    assert masked[0, 3] == logits[0, 3] and masked[2, 11] == logits[2, 11]
    rows = [{}, {"temperature": 1.0, "seed": 3}, {}]
    meta = make_meta(rows, 64)
    meta.all_greedy = meta.all_random = False
    meta.id_sets = {"allowed_token_ids": index}
    assert not is_plain_greedy(meta)
    out = Sampler().forward(logits, meta)
    assert out.sampled_token_ids[0] == 3 + 37 * int(logits[0, 40] > logits[0, 3])
    assert out.sampled_token_ids[2] == 11
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
