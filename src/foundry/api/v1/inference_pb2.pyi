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
    FINISH_REASON_MAX_TOKENS: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_FULL: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_MAX_TOKENS: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_CONTEXT_FULL: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "messages", "top_k")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    top_k: int
    def __init__(self, prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GeneratedToken(_message.Message):
    __slots__ = ("id", "position", "text")
    ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    id: int
    position: int
    text: str
    def __init__(self, id: _Optional[int] = ..., position: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class GenerationDone(_message.Message):
    __slots__ = ("reason", "prompt_tokens", "generated_tokens", "seconds")
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    seconds: float
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "done")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[GeneratedToken]
    done: GenerationDone
    def __init__(self, tokens: _Optional[_Iterable[_Union[GeneratedToken, _Mapping]]] = ..., done: _Optional[_Union[GenerationDone, _Mapping]] = ...) -> None: ...

class GetPairStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPairStatusResponse(_message.Message):
    __slots__ = ("worker_connected", "shared_memory", "active_sessions", "tokens_generated", "requests_served", "spec_acceptance", "n_layer", "n_embd", "n_vocab", "ctx_size", "model_bytes", "model_id", "threads", "ranks")
    WORKER_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    N_LAYER_FIELD_NUMBER: _ClassVar[int]
    N_EMBD_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    CTX_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    worker_connected: bool
    shared_memory: bool
    active_sessions: int
    tokens_generated: int
    requests_served: int
    spec_acceptance: float
    n_layer: int
    n_embd: int
    n_vocab: int
    ctx_size: int
    model_bytes: int
    model_id: int
    threads: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    def __init__(self, worker_connected: _Optional[bool] = ..., shared_memory: _Optional[bool] = ..., active_sessions: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., requests_served: _Optional[int] = ..., spec_acceptance: _Optional[float] = ..., n_layer: _Optional[int] = ..., n_embd: _Optional[int] = ..., n_vocab: _Optional[int] = ..., ctx_size: _Optional[int] = ..., model_bytes: _Optional[int] = ..., model_id: _Optional[int] = ..., threads: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "share", "connected", "gate_wait_seconds", "threads")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    GATE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    share: int
    connected: bool
    gate_wait_seconds: float
    threads: int
    def __init__(self, rank: _Optional[int] = ..., share: _Optional[int] = ..., connected: _Optional[bool] = ..., gate_wait_seconds: _Optional[float] = ..., threads: _Optional[int] = ...) -> None: ...
