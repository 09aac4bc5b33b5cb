from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ParallelLayout(_message.Message):
    __slots__ = ("tp_size", "node_rank", "num_nodes", "num_local_ranks", "rendezvous_address", "group_id")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    node_rank: int
    num_nodes: int
    num_local_ranks: int
    rendezvous_address: str
    group_id: str
    def __init__(self, tp_size: _Optional[int] = ..., node_rank: _Optional[int] = ..., num_nodes: _Optional[int] = ..., num_local_ranks: _Optional[int] = ..., rendezvous_address: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class InitRequest(_message.Message):
    __slots__ = ("config", "layout", "epoch", "scheduler_id")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    config: WorkerConfig
    layout: ParallelLayout
    epoch: int
    scheduler_id: str
    def __init__(self, config: _Optional[_Union[WorkerConfig, _Mapping]] = ..., layout: _Optional[_Union[ParallelLayout, _Mapping]] = ..., epoch: _Optional[int] = ..., scheduler_id: _Optional[str] = ...) -> None: ...

class WorkerConfig(_message.Message):
    __slots__ = ("model_dir", "dtype", "attention_backend", "max_model_len", "block_size", "kv_cache_bytes", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "verify_symmetry", "enforce_eager", "max_graph_batch", "fused_ops", "enable_lora", "lora_modules", "max_loras", "max_lora_rank", "allow_runtime_lora_updating", "disable_hybrid_kv_cache_manager", "cpu_quantized_weights", "kv_cache_dtype", "max_cpu_loras")
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SYMMETRY_FIELD_NUMBER: _ClassVar[int]
    ENFORCE_EAGER_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAPH_BATCH_FIELD_NUMBER: _ClassVar[int]
    FUSED_OPS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_LORA_FIELD_NUMBER: _ClassVar[int]
    LORA_MODULES_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    ALLOW_RUNTIME_LORA_UPDATING_FIELD_NUMBER: _ClassVar[int]
    DISABLE_HYBRID_KV_CACHE_MANAGER_FIELD_NUMBER: _ClassVar[int]
    CPU_QUANTIZED_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    model_dir: str
    dtype: str
    attention_backend: str
    max_model_len: int
    block_size: int
    kv_cache_bytes: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    verify_symmetry: bool
    enforce_eager: bool
    max_graph_batch: int
    fused_ops: bool
    enable_lora: bool
    lora_modules: str
    max_loras: int
    max_lora_rank: int
    allow_runtime_lora_updating: bool
    disable_hybrid_kv_cache_manager: bool
    cpu_quantized_weights: str
    kv_cache_dtype: str
    max_cpu_loras: int
    def __init__(self, model_dir: _Optional[str] = ..., dtype: _Optional[str] = ..., attention_backend: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., verify_symmetry: _Optional[bool] = ..., enforce_eager: _Optional[bool] = ..., max_graph_batch: _Optional[int] = ..., fused_ops: _Optional[bool] = ..., enable_lora: _Optional[bool] = ..., lora_modules: _Optional[str] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., allow_runtime_lora_updating: _Optional[bool] = ..., disable_hybrid_kv_cache_manager: _Optional[bool] = ..., cpu_quantized_weights: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., max_cpu_loras: _Optional[int] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("local_rank", "global_rank", "device_kind", "device_name", "total_memory_bytes", "free_memory_bytes", "num_kv_blocks")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    global_rank: int
    device_kind: str
    device_name: str
    total_memory_bytes: int
    free_memory_bytes: int
    num_kv_blocks: int
    def __init__(self, local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., device_kind: _Optional[str] = ..., device_name: _Optional[str] = ..., total_memory_bytes: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ...) -> None: ...

class InitResponse(_message.Message):
    __slots__ = ("num_kv_blocks", "devices", "epoch", "kv_block_bytes", "stream_key", "sliding_window", "window_group_window", "window_group_blocks", "kv_cache_dtype", "pipelined")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_KEY_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_GROUP_WINDOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_GROUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    epoch: int
    kv_block_bytes: int
    stream_key: bytes
    sliding_window: int
    window_group_window: int
    window_group_blocks: int
    kv_cache_dtype: str
    pipelined: bool
    def __init__(self, num_kv_blocks: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., epoch: _Optional[int] = ..., kv_block_bytes: _Optional[int] = ..., stream_key: _Optional[bytes] = ..., sliding_window: _Optional[int] = ..., window_group_window: _Optional[int] = ..., window_group_blocks: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., pipelined: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("epoch", "step", "payload", "digest")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    payload: bytes
    digest: bytes
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., payload: _Optional[bytes] = ..., digest: _Optional[bytes] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[StepError.Code]
        EPOCH_MISMATCH: _ClassVar[StepError.Code]
        STEP_GAP: _ClassVar[StepError.Code]
        BAD_PAYLOAD: _ClassVar[StepError.Code]
        RANK_FAILED: _ClassVar[StepError.Code]
        SYMMETRY_DIVERGENCE: _ClassVar[StepError.Code]
        INTERNAL: _ClassVar[StepError.Code]
        STALE_EPOCH: _ClassVar[StepError.Code]
    CODE_UNSPECIFIED: StepError.Code
    EPOCH_MISMATCH: StepError.Code
    STEP_GAP: StepError.Code
    BAD_PAYLOAD: StepError.Code
    RANK_FAILED: StepError.Code
    SYMMETRY_DIVERGENCE: StepError.Code
    INTERNAL: StepError.Code
    STALE_EPOCH: StepError.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: StepError.Code
    message: str
    def __init__(self, code: _Optional[_Union[StepError.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("epoch", "step", "payload", "digest", "error")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    payload: bytes
    digest: bytes
    error: StepError
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., payload: _Optional[bytes] = ..., digest: _Optional[bytes] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("epoch", "scheduler_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    scheduler_id: str
    def __init__(self, epoch: _Optional[int] = ..., scheduler_id: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("epoch", "num_dropped_requests", "stream_key")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_KEY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_dropped_requests: int
    stream_key: bytes
    def __init__(self, epoch: _Optional[int] = ..., num_dropped_requests: _Optional[int] = ..., stream_key: _Optional[bytes] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("epoch", "scheduler_id", "lora_id", "name", "path")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    scheduler_id: str
    lora_id: int
    name: str
    path: str
    def __init__(self, epoch: _Optional[int] = ..., scheduler_id: _Optional[str] = ..., lora_id: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoraResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("epoch", "scheduler_id", "lora_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    scheduler_id: str
    lora_id: int
    def __init__(self, epoch: _Optional[int] = ..., scheduler_id: _Optional[str] = ..., lora_id: _Optional[int] = ...) -> None: ...

class UnloadLoraResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "reason", "epoch", "scheduler_id")
    READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    reason: str
    epoch: int
    scheduler_id: str
    def __init__(self, ready: _Optional[bool] = ..., reason: _Optional[str] = ..., epoch: _Optional[int] = ..., scheduler_id: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("device_kind", "devices", "model_loaded", "model_dir", "attention_backend", "layout", "epoch", "dtype", "num_kv_blocks", "group_id", "scheduler_id")
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MODEL_LOADED_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    device_kind: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    model_loaded: bool
    model_dir: str
    attention_backend: str
    layout: ParallelLayout
    epoch: int
    dtype: str
    num_kv_blocks: int
    group_id: str
    scheduler_id: str
    def __init__(self, device_kind: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., model_loaded: _Optional[bool] = ..., model_dir: _Optional[str] = ..., attention_backend: _Optional[str] = ..., layout: _Optional[_Union[ParallelLayout, _Mapping]] = ..., epoch: _Optional[int] = ..., dtype: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., group_id: _Optional[str] = ..., scheduler_id: _Optional[str] = ...) -> None: ...
