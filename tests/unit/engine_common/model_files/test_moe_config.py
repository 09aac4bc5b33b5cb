"""config.json's mixture-of-experts fields no model could be built from are refused when the model
directory is first read (engine_common/model_files/moe_config.py via ModelInfo.from_dir), naming
the field, its value and the allowed range, without torch; the worker's MoeArgs refuses the
same under the same words."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from engine_common.model_files.model_dir import ModelDirError, ModelInfo
from engine_common.model_files.moe_config import moe_config_problem
from tests.support.paths import REPO

GOOD = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "num_local_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16}
BAD = [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is invalid: must be in "
                                 "[1, num_local_experts=8]"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0 is invalid: must be in "
                                 "[1, num_local_experts=8]"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok=None is invalid: must be in "
                                    "[1, num_local_experts=8]"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size=0 is invalid: must be >= 1"),
    ({"num_local_experts": -1}, "num_local_experts=-1 is invalid: must be >= 0"),
    ({"num_local_experts": "8"}, "num_local_experts='8' is invalid: must be an integer"),
    ({"num_local_experts": None, "num_experts": 4, "num_experts_per_tok": 5},
     "num_experts_per_tok=5 is invalid: must be in [1, num_experts=4]"),
]


@pytest.mark.parametrize("change, why", BAD)
def test_an_impossible_moe_config_is_refused_naming_field_value_and_range(tmp_path, change, why):
    config = {**GOOD, **change}        # None stays: a null in config.json
    assert moe_config_problem(config) == why
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError) as e:
        ModelInfo.from_dir(tmp_path)
    assert str(e.value) == f"{tmp_path / 'config.json'}: {why}"


@pytest.mark.parametrize("config", [
    GOOD, {**GOOD, "num_experts_per_tok": 8},                 # top-k = E
    {**GOOD, "num_local_experts": 0, "num_experts_per_tok": 0},   # no sparse layer at all
    {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64},    # a dense model
])
def test_a_servable_config_passes(config):
    assert moe_config_problem(config) is None


def test_the_worker_refuses_the_same_under_the_same_words():
    from worker_service.models.qwen_moe import MoeArgs

    config = {**GOOD, "hidden_size": 32, "moe_intermediate_size": 0}
    with pytest.raises(ValueError, match=r"^config.json: moe_intermediate_size=0 is invalid: "
                                         r"must be >= 1$"):
        MoeArgs.from_hf(config, shared_expert=False)


def test_the_refusal_needs_no_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**GOOD, "num_experts_per_tok": 9}))
    script = textwrap.dedent(f"""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError(name)

        sys.meta_path.insert(0, NoTorch())
        from engine_common.model_files.model_dir import ModelDirError, ModelInfo
        try:
            ModelInfo.from_dir({str(tmp_path)!r})
        except ModelDirError as e:
            print(e)
        assert "torch" not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip().endswith("num_experts_per_tok=9 is invalid: must be in "
                                "[1, num_local_experts=8]"), out
