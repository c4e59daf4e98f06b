from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINING_STATE_UNSPECIFIED: _ClassVar[TrainingState]
    TRAINING_STATE_WAITING: _ClassVar[TrainingState]
    TRAINING_STATE_TRAINING: _ClassVar[TrainingState]
    TRAINING_STATE_PAUSED: _ClassVar[TrainingState]
    TRAINING_STATE_DONE: _ClassVar[TrainingState]
    TRAINING_STATE_FAILED: _ClassVar[TrainingState]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_REGISTERED: _ClassVar[WorkerState]
    WORKER_STATE_TRAINING: _ClassVar[WorkerState]
    WORKER_STATE_IDLE: _ClassVar[WorkerState]
    WORKER_STATE_DROPPED: _ClassVar[WorkerState]
TRAINING_STATE_UNSPECIFIED: TrainingState
TRAINING_STATE_WAITING: TrainingState
TRAINING_STATE_TRAINING: TrainingState
TRAINING_STATE_PAUSED: TrainingState
TRAINING_STATE_DONE: TrainingState
TRAINING_STATE_FAILED: TrainingState
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_REGISTERED: WorkerState
WORKER_STATE_TRAINING: WorkerState
WORKER_STATE_IDLE: WorkerState
WORKER_STATE_DROPPED: WorkerState

class Worker(_message.Message):
    __slots__ = ("worker_id", "profile", "state", "batch_size", "accumulation_steps", "samples_per_second", "loss", "local_step", "seconds_since_heartbeat", "inner_steps", "bytes_up", "bytes_down")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    profile: str
    state: WorkerState
    batch_size: int
    accumulation_steps: int
    samples_per_second: float
    loss: float
    local_step: int
    seconds_since_heartbeat: float
    inner_steps: int
    bytes_up: int
    bytes_down: int
    def __init__(self, worker_id: _Optional[str] = ..., profile: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., batch_size: _Optional[int] = ..., accumulation_steps: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., loss: _Optional[float] = ..., local_step: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., inner_steps: _Optional[int] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ...) -> None: ...

class TrainingStatus(_message.Message):
    __slots__ = ("global_step", "max_steps", "state", "train_loss", "validation_loss", "samples_per_second", "learning_rate", "samples_total", "workers", "note", "min_workers", "seconds_since_step")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    max_steps: int
    state: TrainingState
    train_loss: float
    validation_loss: float
    samples_per_second: float
    learning_rate: float
    samples_total: int
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    note: str
    min_workers: int
    seconds_since_step: float
    def __init__(self, global_step: _Optional[int] = ..., max_steps: _Optional[int] = ..., state: _Optional[_Union[TrainingState, str]] = ..., train_loss: _Optional[float] = ..., validation_loss: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., learning_rate: _Optional[float] = ..., samples_total: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., note: _Optional[str] = ..., min_workers: _Optional[int] = ..., seconds_since_step: _Optional[float] = ...) -> None: ...

class StartTrainingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartTrainingResponse(_message.Message):
    __slots__ = ("global_step", "message")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    message: str
    def __init__(self, global_step: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PauseTrainingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseTrainingResponse(_message.Message):
    __slots__ = ("global_step", "message")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    message: str
    def __init__(self, global_step: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ResumeTrainingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeTrainingResponse(_message.Message):
    __slots__ = ("global_step", "message")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    message: str
    def __init__(self, global_step: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CreateCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateCheckpointResponse(_message.Message):
    __slots__ = ("global_step", "path")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    path: str
    def __init__(self, global_step: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class ShutdownTrainingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownTrainingResponse(_message.Message):
    __slots__ = ("global_step", "message")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    message: str
    def __init__(self, global_step: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GetTrainingStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainingStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: TrainingStatus
    def __init__(self, status: _Optional[_Union[TrainingStatus, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ...) -> None: ...

class WatchTrainingStatusRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class WatchTrainingStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: TrainingStatus
    def __init__(self, status: _Optional[_Union[TrainingStatus, _Mapping]] = ...) -> None: ...
