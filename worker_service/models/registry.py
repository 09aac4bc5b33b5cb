"""Architecture registry: Hugging Face `architectures[0]` -> model class.

Adding an architecture means adding a line here; nothing else branches on the name.
"""
from __future__ import annotations

from types import MappingProxyType

from torch import nn

from worker_service.models.bert import BertModel, RobertaModel
from worker_service.models.classifiers import (BertForSequenceClassification,
                                               LlamaForSequenceClassification,
                                               Qwen2ForSequenceClassification,
                                               Qwen3ForSequenceClassification,
                                               RobertaForSequenceClassification)
from worker_service.models.cohere import Cohere2ForCausalLM, CohereForCausalLM
from worker_service.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from worker_service.models.gemma import GemmaForCausalLM
from worker_service.models.gemma2 import Gemma2ForCausalLM
from worker_service.models.gemma3 import Gemma3ForCausalLM
from worker_service.models.glm import Glm4ForCausalLM, GlmForCausalLM
from worker_service.models.gpt_oss import GptOssForCausalLM
from worker_service.models.granite import GraniteForCausalLM
from worker_service.models.llama import (LlamaForCausalLM, MistralForCausalLM,
                                         Qwen2ForCausalLM, Qwen3ForCausalLM)
from worker_service.models.mixtral import MixtralForCausalLM
from worker_service.models.olmo2 import Olmo2ForCausalLM
from worker_service.models.phi3 import Phi3ForCausalLM
from worker_service.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from worker_service.models.smollm3 import SmolLM3ForCausalLM
from worker_service.models.starcoder2 import Starcoder2ForCausalLM

MODEL_REGISTRY = MappingProxyType({
    # encoder embedding models (--runner pooling only): engine_common's ENCODER_ARCHITECTURES
    "BertForMaskedLM": BertModel,
    "BertModel": BertModel,
    "RobertaForMaskedLM": RobertaModel,
    "RobertaModel": RobertaModel,
    "XLMRobertaForMaskedLM": RobertaModel,
    "XLMRobertaModel": RobertaModel,
    # classification (cross-encoder) models, --runner pooling only: engine_common's
    # ENCODER_CLASSIFIERS and DECODER_CLASSIFIERS
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
})


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture this engine has no implementation for."""


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(MODEL_REGISTRY))


def get_model_class(arch: str, auto_map: dict | None = None) -> type[nn.Module]:
    """The class implementing `arch`, or UnsupportedArchitectureError listing the known ones.
    `auto_map` (config.json's): the checkpoint ships code of its own for its classes; an
    unknown `arch` is then said to be that code's, which is never run (vLLM's
    --trust-remote-code would run it)."""
    try:
        return MODEL_REGISTRY[arch]
    except KeyError:
        own_code = (" (config.json's auto_map names the checkpoint's own code for it, which "
                    "DeltaServe never runs, --trust-remote-code or not)" if auto_map else "")
        raise UnsupportedArchitectureError(
            f"architecture={arch!r} is not supported{own_code}: must be one of "
            f"{supported_architectures()}") from None
