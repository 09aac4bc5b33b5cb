"""Logits -> next tokens, identically on every rank.

Order of operations on the [N, V] float32 logits:
  0. allowed_token_ids (a row's other ids -> -inf), then logit bias (the request's per-token
     biases) added
  1. stop masks (ids forbidden before min_tokens) -> -inf; grammar masks (structured output:
     ids outside a constrained row's mask) -> -inf, added as a 0 / -inf bias
  2. penalties: repetition on prompt+output ids (positive logits divided, negative multiplied),
     then frequency (x count) and presence (x seen) on output ids, subtracted
  3. greedy rows: argmax
  4. random rows: / temperature, min-p, top-k, top-p (vLLM's order), then Gumbel-max:
     argmax(x + g), g = -log(-log(u)), u = hash(seed, counter, vocab id) in (0, 1).
The noise is a pure integer function of (seed, counter, vocab id): no torch.Generator, so a request
draws the same token whatever else is in the batch, and on every rank and device. No step reads a
device value on the host (top-k's width is meta.top_k_max), so sampling never syncs. Returned
logprobs are those of the raw model distribution (log_softmax of the unprocessed logits); a step
where no row wants one (meta.wants_logprobs False) computes none (on the CPU the greedy kernels
then skip their exponentials) and returns an empty logprob tensor.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu.fused import ops_for
from worker_service.sample.grammar import GrammarMasks
from worker_service.sample.sampling_metadata import SamplingMetadata

_M32 = 0xFFFFFFFF
# Elements of noise computed at once (bounds the two int64 temporaries to 64 MiB each).
_NOISE_CHUNK_ELEMENTS = 1 << 23


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor          # int64 [N]
    # float32 [N], raw log_softmax at the sampled ids; [0] when no row wants its logprob
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None      # int64 [N, k], best first
    top_logprobs: torch.Tensor | None = None  # float32 [N, k], descending


# Multipliers of the mixer below; both < 2^31, so x * c < 2^63 for any 32-bit x (no overflow).
_MIX_A, _MIX_B = 0x21F0AAAD, 0x735A2D97


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """32-bit avalanche mixer (xor-shift 16, multiply, xor-shift 15, multiply, xor-shift 15) on
    int64 values in [0, 2^32), in place; `tmp` is scratch of x's shape."""
    for shift, mult in ((16, _MIX_A), (15, _MIX_B), (15, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(mult).bitwise_and_(_M32)
    return x


def _mix32(x: torch.Tensor) -> torch.Tensor:
    return _mix32_(x.clone(), torch.empty_like(x))


def _row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from the 64-bit seed and the 64-bit counter."""
    key = _mix32(seeds & _M32)
    key = _mix32(key ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (counters & _M32))
    return _mix32(key ^ ((counters >> 32) & _M32))


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise, float32 [N, V], a pure function of (seed, counter, vocab id)."""
    keys = _row_keys(seeds.long(), counters.long())
    cols = _mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) ^ 0x9E3779B9)
    bits = keys[:, None] ^ cols[None, :]
    _mix32_(bits, torch.empty_like(bits))
    u = bits.double().add_(0.5).mul_(1.0 / 2**32)  # strictly inside (0, 1)
    return u.log_().neg_().log_().neg_().float()   # -log(-log(u))


def _gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """argmax(x + noise) by chunks of rows, so the noise never exists for the whole batch."""
    n, vocab = x.shape
    step = max(1, _NOISE_CHUNK_ELEMENTS // vocab)
    parts = [gumbel_noise(seeds[i:i + step], counters[i:i + step], vocab)
             .add_(x[i:i + step]).argmax(dim=-1) for i in range(0, n, step)]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def apply_stop_masks(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """-inf at every (row, id) pair of index (int64 [2, K]); a copy when anything is masked."""
    if index is None or index.shape[1] == 0:
        return x
    x = x.clone()
    x.index_put_((index[0], index[1]), x.new_full((), float("-inf")))
    return x


def apply_logit_bias(x: torch.Tensor, index: torch.Tensor | None,
                     values: torch.Tensor | None) -> torch.Tensor:
    """x plus `values` (float32 [K]) at the (row, id) pairs of `index` (int64 [2, K]; the pairs
    are distinct); a copy when anything is biased."""
    if index is None or index.shape[1] == 0:
        return x
    return x.index_put((index[0], index[1]), values, accumulate=True)


def apply_allowed_token_ids(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """-inf at every id of a restricted row but the (row, id) pairs of `index` (int64 [2, K]:
    the rows' allowed_token_ids); rows with no pair keep every logit. A copy when any row is
    restricted; no device value is read."""
    if index is None or index.shape[1] == 0:
        return x
    allowed = torch.zeros_like(x, dtype=torch.bool)
    allowed[index[0], index[1]] = True
    restricted = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    restricted[index[0]] = True
    return x.masked_fill(restricted[:, None] & ~allowed, float("-inf"))


def bitmask_to_bias(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [K, vocab]: 0 where the bitmask (int32 [K, ceil(V / 32)]; bit t % 32 of word
    t // 32 allows id t) allows an id, -inf elsewhere; on the bitmask's device."""
    # Little-endian words: byte b of a row holds ids 8b .. 8b+7, bit j is id 8b+j.
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    row_bytes = bitmask.contiguous().view(torch.uint8)
    allowed = ((row_bytes[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    zero = torch.zeros((), dtype=torch.float32, device=bitmask.device)
    return torch.where(allowed, zero, float("-inf"))


def apply_grammar_bias(x: torch.Tensor, rows: torch.Tensor | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x + bias on the constrained rows (bias float32 [K, V] of 0 / -inf; rows int64 [K], or
    None when every row is constrained, in order); allowed logits keep their exact values.
    Out of place."""
    if bias is None:
        return x
    if rows is None:
        return x + bias
    return x.index_add(0, rows, bias)


def _token_mask(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [N, V]: True where the id occurs in the row (padding id `vocab` dropped)."""
    mask = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab]


def apply_penalties(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output ids), then frequency and presence (output ids); out of place."""
    vocab = x.shape[1]
    out_ids = meta.output_token_ids
    if meta.repetition_penalty is not None:
        seen = torch.zeros_like(x, dtype=torch.bool)
        for ids in (meta.prompt_token_ids, out_ids):
            if ids is not None:
                seen |= _token_mask(ids, vocab)
        p = meta.repetition_penalty[:, None]
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    if out_ids is not None and (meta.frequency_penalty is not None
                                or meta.presence_penalty is not None):
        counts = torch.zeros(x.shape[0], vocab + 1, dtype=x.dtype, device=x.device)
        counts = counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=x.dtype))
        counts = counts[:, :vocab]
        if meta.frequency_penalty is not None:
            x = x - meta.frequency_penalty[:, None] * counts
        if meta.presence_penalty is not None:
            x = x - meta.presence_penalty[:, None] * (counts > 0).to(x.dtype)
    return x


def apply_top_k(x: torch.Tensor, top_k: torch.Tensor, top_k_max: int) -> torch.Tensor:
    """Keep each row's top_k largest logits (0 = off; ties at the boundary are kept).
    top_k_max: a host-known bound of the active top_k values, so no device value is read."""
    vocab = x.shape[1]
    active = (top_k > 0) & (top_k < vocab)
    k = torch.where(active, top_k.long(), 1)
    k_max = max(1, min(top_k_max, vocab))
    kth = x.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])
    kth = torch.where(active[:, None], kth, float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor) -> torch.Tensor:
    """Both filters on one ascending sort; ties at the top-k boundary are kept."""
    vocab = x.shape[1]
    sorted_x, order = x.sort(dim=-1)
    if top_k is not None:
        active = (top_k > 0) & (top_k < vocab)
        kth = sorted_x.gather(1, (vocab - torch.where(active, top_k.long(), vocab))[:, None])
        sorted_x = sorted_x.masked_fill(active[:, None] & (sorted_x < kth), float("-inf"))
    # Drop the low tail whose total mass is <= 1 - top_p; the best token always survives.
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = (cum <= (1.0 - top_p)[:, None]) & (top_p < 1.0)[:, None]
    drop[:, -1].fill_(False)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with p >= min_p * p_max, i.e. x >= x_max + log(min_p)."""
    threshold = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return x.masked_fill(x < threshold, float("-inf"))


def _sample_random(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    temperature = torch.where(meta.temperature > 0, meta.temperature, 1.0)
    x = x / temperature[:, None]
    # min-p first, as vLLM: top-p then measures the mass of the min-p survivors.
    if meta.min_p is not None:
        x = apply_min_p(x, meta.min_p)
    if meta.top_p is not None:
        x = apply_top_k_top_p(x, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        x = apply_top_k(x, meta.top_k, meta.top_k_max)
    return _gumbel_argmax(x, meta.seeds, meta.counters)


def with_grammar_masks(meta: SamplingMetadata, masks: GrammarMasks, device: torch.device,
                       vocab_size: int) -> SamplingMetadata:
    """`meta` with the step's grammar masks as the sampler's bias: on CPU unpacked on the helper
    thread; on a device the bitmask goes through pinned memory (no sync) and is unpacked there."""
    def put(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if t.device == device else t.pin_memory().to(device, non_blocking=True)
    if masks.bias is not None:
        bias = torch.from_numpy(masks.bias)
    else:
        bias = bitmask_to_bias(put(masks.bitmask), vocab_size)
    rows = None if masks.all_rows else put(masks.indices)
    return dataclasses.replace(meta, grammar_rows=rows, grammar_bias=bias)


def is_plain_greedy(meta: SamplingMetadata) -> bool:
    """Argmax of the raw logits and their logprob is all this step needs (no grammar masks)."""
    return (meta.all_greedy and not meta.has_penalties and meta.max_num_logprobs == 0
            and meta.grammar_bias is None and meta.logit_bias_index is None and not meta.id_sets
            and (meta.stop_mask_index is None or meta.stop_mask_index.shape[1] == 0))


class Sampler:
    """Stateless: `forward(logits, meta)` never modifies `logits`. A plain greedy step (no
    penalties, stop masks or top alternatives) takes a one-pass argmax and logprob: on the CPU
    kernels/cpu's, on CUDA kernels/greedy_sample.py's (same ids; ties go to the first index, as
    argmax does)."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        if logits.shape[0] == 0:
            empty = logits.new_zeros(0)
            return SamplerOutput(empty.long(), empty)
        if is_plain_greedy(meta):
            if logits.is_cuda:    # one pass over the logits (Triton) instead of five
                from kernels.greedy_sample import greedy_sample
                return SamplerOutput(*greedy_sample(logits))
            ops = ops_for(torch.float32) if logits.device.type == "cpu" else None
            if ops is not None:
                return SamplerOutput(*ops.greedy_sample(logits, meta.wants_logprobs))
        x = apply_allowed_token_ids(logits, meta.id_sets.get("allowed_token_ids"))
        x = apply_logit_bias(x, meta.logit_bias_index, meta.logit_bias_values)
        x = apply_stop_masks(x, meta.stop_mask_index)
        x = apply_grammar_bias(x, meta.grammar_rows, meta.grammar_bias)
        if meta.has_penalties:
            x = apply_penalties(x, meta)
        if meta.all_greedy:
            tokens = x.argmax(dim=-1)
        elif meta.all_random:
            tokens = _sample_random(x, meta)
        else:  # compute both and pick per row: no device->host sync
            tokens = torch.where(meta.temperature > 0, _sample_random(x, meta), x.argmax(dim=-1))
        if not meta.wants_logprobs:
            return SamplerOutput(tokens, logits.new_zeros(0))
        return self._with_logprobs(logits, tokens, meta.max_num_logprobs)

    __call__ = forward

    def from_model_output(self, out: torch.Tensor, is_hidden: bool, meta: SamplingMetadata,
                          model) -> SamplerOutput:
        """Sample from the model's output rows: logits, or hidden states (then a plain greedy
        step on the CPU takes the LM head's fused argmax, which never builds the logits)."""
        if not is_hidden:
            return self.forward(out, meta)
        if is_plain_greedy(meta):
            fused = model.lm_head.greedy(out, meta.wants_logprobs)
            if fused is not None:
                return SamplerOutput(*fused)
        return self.forward(model.compute_logits(out), meta)

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SamplerOutput:
        lse = torch.logsumexp(logits, dim=-1)
        logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - lse
        out = SamplerOutput(tokens, logprobs)
        if k > 0:
            values, ids = logits.topk(min(k, logits.shape[1]), dim=-1)
            out.top_ids, out.top_logprobs = ids, values - lse[:, None]
        return out
