"""CUDA graphs for pure-decode steps: capture once per batch size at start-up, pad, replay.

A decode step launches a few hundred small kernels; replaying them as one graph removes the
per-kernel launch cost that dominates small batches. Rules:

* Batch sizes: 1, 2, 4, 8, then every multiple of 16 up to max_graph_batch (and
  max_graph_batch itself, so every batch up to it has a graph). A step with n requests runs the
  smallest captured size >= n; the extra rows are padding (see decode_buffers.py).
* Only pure-decode steps (every scheduled request has exactly one query token) replay a graph;
  prefill, chunked prefill and mixed steps, and batches above max_graph_batch, run eagerly.
* Each graph covers model forward over the persistent buffers plus a copy of the hidden states
  into one static [max_graph_batch, hidden] buffer. The LM head runs after the replay, on the
  real rows only: keeping [b, vocab] logits inside every graph would pin one logits tensor per
  captured size in the pool (GBs for a 150k vocabulary), and one static logits buffer would cost
  an extra b x vocab copy per step.
* All graphs share one memory pool; the largest is captured first so smaller ones reuse its
  blocks.
* The attention backend must be capturable: no host syncs and no data-dependent launch shapes.
  Triton is (its decode split count is chosen on the host from the batch size and the
  max_seq_len bound in the metadata, i.e. fixed per graph; any split count is correct for any
  length), and so is flash-attn's kvcache path (its split heuristic reads shapes only). The torch
  reference backend is not: it loops over requests with host copies (.tolist()).
* --enforce-eager turns graphs off.
* A step's inputs come from the runner's staging (StepBuffers, shared): `stage` writes the padded
  rows on the host, the runner flushes every arena once, then `replay` copies them device to
  device into the graph's buffers and replays. No host sync anywhere on that path.
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch
from torch import nn

from engine_common.runtime.progress import Progress
from worker_service.step.decode_buffers import DecodeBuffers, StagedDecode
from worker_service.step.step_buffers import StepBuffers

log = logging.getLogger(__name__)

SMALL_GRAPH_SIZES = (1, 2, 4, 8)
GRAPH_SIZE_STEP = 16
CAPTURABLE_BACKENDS = ("triton", "flash_attn")


def graph_batch_sizes(max_graph_batch: int) -> list[int]:
    """[1, 2, 4, 8, 16, 32, ...] up to max_graph_batch, which is always the last size."""
    if max_graph_batch < 1:
        raise ValueError(f"max_graph_batch={max_graph_batch} is invalid: must be >= 1")
    sizes = [s for s in SMALL_GRAPH_SIZES if s <= max_graph_batch]
    sizes += range(GRAPH_SIZE_STEP, max_graph_batch + 1, GRAPH_SIZE_STEP)
    if sizes[-1] != max_graph_batch:
        sizes.append(max_graph_batch)
    return sizes


def padded_batch_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest size in `sizes` (ascending) that holds num_reqs; None if none does."""
    if num_reqs < 1:
        return None
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def graphs_unsupported_reason(backend_name: str, device: torch.device | str,
                              enforce_eager: bool = False, model: object = None) -> str | None:
    """Why decode steps cannot use CUDA graphs here, or None when they can. A model whose
    forward syncs with the host says why in `graph_capture_blocker` (capture would fail)."""
    if enforce_eager:
        return "enforce_eager is set"
    blocker = getattr(model, "graph_capture_blocker", None)
    if blocker:
        return f"the model cannot be captured ({blocker})"
    if torch.device(device).type != "cuda":
        return f"device {device} is not a CUDA device"
    if backend_name not in CAPTURABLE_BACKENDS:
        return (f"attention backend {backend_name!r} is not capturable (only "
                f"{CAPTURABLE_BACKENDS}; the torch reference syncs with the host per request)")
    return None


class DecodeGraphRunner:
    """Runs pure-decode steps of `model` from persistent buffers, replaying a captured graph
    when there is one for the padded batch size and running the same code eagerly otherwise
    (before capture(), or on CPU in tests).

    Graphs bake in the addresses of `kv_caches` and of the weights: build a new runner (and
    capture again) whenever the KV cache is re-allocated. `staging` is the model runner's
    StepBuffers (a private one, sized for max_graph_batch, when None).
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_graph_batch: int,
                 max_blocks_per_req: int, max_model_len: int, device: torch.device | str,
                 staging: StepBuffers | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.sizes = graph_batch_sizes(max_graph_batch)
        self.buffers = DecodeBuffers(max_graph_batch, max_blocks_per_req, self.device,
                                     max_model_len)
        self.staging = staging or StepBuffers(max_graph_batch, max_graph_batch,
                                              max_blocks_per_req, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: torch.Tensor | None = None     # [max_graph_batch, hidden], static

    @staticmethod
    def supported(backend_name: str, device: torch.device | str) -> bool:
        """Whether graphs can be captured for this backend on this device."""
        return graphs_unsupported_reason(backend_name, device) is None

    def graph_batch(self, num_reqs: int, num_tokens: int, max_query_len: int) -> int | None:
        """The padded batch size this step would run at, or None if it must run eagerly
        (not one token per request, or more requests than the largest graph)."""
        if max_query_len != 1 or num_tokens != num_reqs:
            return None
        return padded_batch_size(num_reqs, self.sizes)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, into one shared pool. Each size is
        run once eagerly first (Triton compiles, cuBLAS picks its kernels) over padding rows,
        which write nothing into the KV cache."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.buffers.reset()
        pool = torch.cuda.graph_pool_handle()
        # The long step after the weights on a GPU (seconds to a minute): say how far it is.
        progress = Progress(f"capturing decode CUDA graphs on {self.device}", len(self.sizes),
                            "batch sizes", emit=log.info)
        for batch in reversed(self.sizes):
            self._forward(batch)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(batch)
            self.graphs[batch] = graph
            progress.advance()
        torch.cuda.synchronize(self.device)

    def run(self, num_reqs: int, input_ids: np.ndarray, positions: np.ndarray,
            slot_mapping: np.ndarray, seq_lens: np.ndarray,
            block_table: np.ndarray) -> torch.Tensor:
        """One decode step for num_reqs requests (one token each, host arrays as StepInputs
        holds them): begin, stage, flush, replay. Writes their keys/values into the KV cache
        and returns float32 logits [num_reqs, vocab]. Read the result (a host sync) before the
        next call: the staging reuse rule of step_buffers.py applies."""
        self.staging.begin()
        staged = self.stage(num_reqs, input_ids, positions, slot_mapping, seq_lens, block_table)
        self.staging.flush()
        return self.replay(staged)

    def stage(self, num_reqs: int, input_ids: np.ndarray, positions: np.ndarray,
              slot_mapping: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
              staging: StepBuffers | None = None) -> StagedDecode:
        """Write a step's rows, padded to its graph size, into the staging arenas (host):
        `staging`'s, else the ones this runner was built with."""
        padded = padded_batch_size(num_reqs, self.sizes)
        if padded is None:
            raise ValueError(f"num_reqs={num_reqs} is invalid: must be in "
                             f"[1, {self.sizes[-1]}]")
        return self.buffers.stage(staging or self.staging, num_reqs, padded, input_ids,
                                  positions, slot_mapping, seq_lens, block_table)

    def replay(self, staged: StagedDecode) -> torch.Tensor:
        """Load a staged step (after the staging flush) and replay its graph (or run the same
        forward eagerly when none was captured); float32 logits [num_reqs, vocab]."""
        return self.model.compute_logits(self.replay_hidden(staged))

    def replay_hidden(self, staged: StagedDecode) -> torch.Tensor:
        """As replay, but the final hidden states [num_reqs, hidden] (a view of the static
        buffer, valid until the next replay): the sampler may then apply the LM head itself."""
        self.buffers.load(staged)
        graph = self.graphs.get(staged.padded)
        if graph is None:
            self._forward(staged.padded)
        else:
            graph.replay()
        return self._hidden[:staged.num_reqs]

    def _forward(self, batch: int) -> None:
        """Model forward over the first `batch` buffer rows into the static hidden buffer."""
        input_ids, positions = self.buffers.model_inputs(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, self.buffers.metadata(batch))
        if self._hidden is None:
            self._hidden = hidden.new_empty((self.buffers.max_batch,) + hidden.shape[1:])
        self._hidden[:batch].copy_(hidden)
