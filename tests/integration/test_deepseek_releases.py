"""DeepSeek-family models shaped like each release (tests/support/deepseek_releases.py: the
released config.json keys and routing / rope values, tiny sizes) against transformers on the
same weights: prefill logits through the paged cache with prompts past
original_max_position_embeddings (yarn's interpolated frequencies and mscale in play), in
float32 (close) and bfloat16 (as close to float32 as transformers' own bfloat16 run)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention.cpu_paged import CpuPagedAttentionBackend
from kernels.cpu import extension
from tests.support.deepseek_releases import ORIGINAL, RELEASES, make_release_model
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import BACKEND, prefill_logits
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group

PROMPT_LEN = 3 * ORIGINAL + 5
CPU_KERNEL = pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")


@pytest.fixture(scope="module")
def release_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    return {name: make_release_model(root / name, name) for name in RELEASES}


def _ids() -> torch.Tensor:
    return torch.arange(PROMPT_LEN) * 37 % 500 + 3


def _logits(path: str, dtype: torch.dtype,
            backend=BACKEND) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _ids()
    ours = load_model(path, single_rank_group(), backend, "cpu", dtype=dtype)
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    return prefill_logits(ours, ids).float(), expected


@pytest.mark.parametrize("release", list(RELEASES))
def test_release_logits_match_transformers_fp32(release_dirs, release):
    got, expected = _logits(release_dirs[release], torch.float32)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-4)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=CPU_KERNEL)],
                         ids=["torch", "cpu-kernel"])
@pytest.mark.parametrize("release", list(RELEASES))
def test_release_bf16_errs_no_more_than_transformers_bf16(release_dirs, release, kernel):
    """bfloat16 against the float32 reference: our error and top-1 agreement as good as
    transformers' own bfloat16 run (tiny random weights amplify rounding, and bf16 can flip a
    routing choice, so the reference for "close" is transformers' bf16, not a fixed bound)."""
    path = release_dirs[release]
    backend = CpuPagedAttentionBackend() if kernel else BACKEND
    got, truth = _logits(path, torch.bfloat16, backend)
    assert not kernel or backend.calls == 3           # the latent (64) on the kernel
    with torch.no_grad():
        theirs = hf_model(path, torch.bfloat16)(_ids()[None]).logits[0].float()
    assert (got - truth).abs().mean() <= 1.25 * (theirs - truth).abs().mean()
    agree = lambda x: (x.argmax(-1) == truth.argmax(-1)).float().mean()
    assert agree(got) >= agree(theirs) - 0.08
