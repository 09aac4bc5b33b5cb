from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    STOP_TOKEN: _ClassVar[FinishReason]
    STOP_STRING: _ClassVar[FinishReason]
    ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
LENGTH: FinishReason
STOP_TOKEN: FinishReason
STOP_STRING: FinishReason
ABORT: FinishReason

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("lora_id",)
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    def __init__(self, lora_id: _Optional[int] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("lora_name", "lora_path", "lora_id", "static")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    STATIC_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    lora_id: int
    static: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., lora_id: _Optional[int] = ..., static: _Optional[bool] = ...) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "stopping", "logprobs", "priority", "messages", "constraint", "prompt_logprobs", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    logprobs: int
    priority: int
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    constraint: Constraint
    prompt_logprobs: int
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., logprobs: _Optional[int] = ..., priority: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "regex", "grammar", "json_object", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    grammar: str
    json_object: bool
    choice: ChoiceConstraint
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., choice: _Optional[_Union[ChoiceConstraint, _Mapping]] = ...) -> None: ...

class ChoiceConstraint(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logit_bias", "allowed_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "usage", "finish_reason", "stop_token_id", "stop_string", "timings", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    usage: Usage
    finish_reason: FinishReason
    stop_token_id: int
    stop_string: str
    timings: Timings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptTokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptTokenLogprob, _Mapping]]] = ...) -> None: ...

class PromptTokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queued_s", "time_to_first_token_s", "total_s")
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    queued_s: float
    time_to_first_token_s: float
    total_s: float
    def __init__(self, queued_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "messages")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "num_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "vocab_size", "eos_token_ids", "tp_size", "num_kv_blocks", "kv_block_size", "default_sampling", "max_logprobs", "has_chat_template", "runner", "pooling_type", "pooling_normalize", "num_labels", "labels")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    POOLING_NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LABELS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    num_kv_blocks: int
    kv_block_size: int
    default_sampling: SamplingParams
    max_logprobs: int
    has_chat_template: bool
    runner: str
    pooling_type: str
    pooling_normalize: bool
    num_labels: int
    labels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., default_sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_logprobs: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., runner: _Optional[str] = ..., pooling_type: _Optional[str] = ..., pooling_normalize: _Optional[bool] = ..., num_labels: _Optional[int] = ..., labels: _Optional[_Iterable[str]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "embedding", "num_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embedding: _containers.RepeatedScalarFieldContainer[float]
    num_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., embedding: _Optional[_Iterable[float]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("request_id", "input", "activation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input: _containers.RepeatedScalarFieldContainer[str]
    activation: bool
    def __init__(self, request_id: _Optional[str] = ..., input: _Optional[_Iterable[str]] = ..., activation: _Optional[bool] = ...) -> None: ...

class ClassifyResult(_message.Message):
    __slots__ = ("index", "label", "probs", "num_classes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    index: int
    label: str
    probs: _containers.RepeatedScalarFieldContainer[float]
    num_classes: int
    def __init__(self, index: _Optional[int] = ..., label: _Optional[str] = ..., probs: _Optional[_Iterable[float]] = ..., num_classes: _Optional[int] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("request_id", "data", "num_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data: _containers.RepeatedCompositeFieldContainer[ClassifyResult]
    num_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., data: _Optional[_Iterable[_Union[ClassifyResult, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "text_1", "text_2", "activation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_1_FIELD_NUMBER: _ClassVar[int]
    TEXT_2_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text_1: _containers.RepeatedScalarFieldContainer[str]
    text_2: _containers.RepeatedScalarFieldContainer[str]
    activation: bool
    def __init__(self, request_id: _Optional[str] = ..., text_1: _Optional[_Iterable[str]] = ..., text_2: _Optional[_Iterable[str]] = ..., activation: _Optional[bool] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("index", "score")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "data", "num_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    num_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., data: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class GetServerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerStatusResponse(_message.Message):
    __slots__ = ("num_waiting", "num_running", "kv_cache_usage", "prefix_cache_hit_rate", "generation_tokens_per_s", "prompt_tokens_per_s", "num_workers_ready", "num_workers", "num_used_kv_blocks", "num_kv_blocks", "num_used_window_kv_blocks", "num_window_kv_blocks", "max_steps_in_flight", "num_steps_in_flight")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_READY_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_WINDOW_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    num_workers_ready: int
    num_workers: int
    num_used_kv_blocks: int
    num_kv_blocks: int
    num_used_window_kv_blocks: int
    num_window_kv_blocks: int
    max_steps_in_flight: int
    num_steps_in_flight: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., generation_tokens_per_s: _Optional[float] = ..., prompt_tokens_per_s: _Optional[float] = ..., num_workers_ready: _Optional[int] = ..., num_workers: _Optional[int] = ..., num_used_kv_blocks: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_used_window_kv_blocks: _Optional[int] = ..., num_window_kv_blocks: _Optional[int] = ..., max_steps_in_flight: _Optional[int] = ..., num_steps_in_flight: _Optional[int] = ...) -> None: ...
