"""GPT-OSS's swiglu_alpha / swiglu_limit read as transformers' GptOssConfig reads them: absent,
its defaults; null (which raised a bare TypeError from float(None)) and other non-numbers
refused naming the key, as transformers' strict config refuses them."""
from __future__ import annotations

import pytest

from worker_service.models.gpt_oss import swiglu_constant


def test_absent_is_gpt_oss_configs_default_and_numbers_are_read():
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig()
    assert swiglu_constant({}, "swiglu_limit", 7.0) == config.swiglu_limit
    assert swiglu_constant({}, "swiglu_alpha", 1.702) == config.swiglu_alpha
    assert swiglu_constant({"swiglu_limit": 1.5}, "swiglu_limit", 7.0) == 1.5
    assert swiglu_constant({"swiglu_limit": 7}, "swiglu_limit", 7.0) == 7.0


@pytest.mark.parametrize("value", [None, "7", True, float("nan")])
def test_null_and_non_numbers_are_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=rf"swiglu_limit={value!r} is invalid for "
                                         r"GptOssForCausalLM: must be a number"):
        swiglu_constant({"swiglu_limit": value}, "swiglu_limit", 7.0)


def test_transformers_refuses_null_too():
    """The reference: GptOssConfig will not hold a null limit, so nothing serves it."""
    transformers = pytest.importorskip("transformers")
    with pytest.raises(Exception, match="swiglu_limit"):
        transformers.GptOssConfig.from_dict({"swiglu_limit": None})


def test_a_null_limit_is_refused_when_the_model_is_built(tiny_models, tmp_path):
    from tests.support.config_edit import with_config
    from tests.support.paged_prefill import load
    path = with_config(tiny_models("gpt_oss"), tmp_path / "null", swiglu_limit=None)
    with pytest.raises(ValueError, match=r"swiglu_limit=None is invalid for GptOssForCausalLM"):
        load(path)
