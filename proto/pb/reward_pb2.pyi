from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Style(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STYLE_UNSPECIFIED: _ClassVar[Style]
    STYLE_SAMPLE: _ClassVar[Style]
    STYLE_BATCH: _ClassVar[Style]
    STYLE_TOOL: _ClassVar[Style]
    STYLE_ENVIRONMENT: _ClassVar[Style]

class Isolation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ISOLATION_UNSPECIFIED: _ClassVar[Isolation]
    ISOLATION_SAMPLE: _ClassVar[Isolation]
    ISOLATION_WORKER: _ClassVar[Isolation]
    ISOLATION_PROCESS: _ClassVar[Isolation]

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNSPECIFIED: _ClassVar[Status]
    STATUS_OK: _ClassVar[Status]
    STATUS_ERROR: _ClassVar[Status]
    STATUS_TIMEOUT: _ClassVar[Status]
    STATUS_CRASH: _ClassVar[Status]
    STATUS_INVALID: _ClassVar[Status]
    STATUS_UNAVAILABLE: _ClassVar[Status]
STYLE_UNSPECIFIED: Style
STYLE_SAMPLE: Style
STYLE_BATCH: Style
STYLE_TOOL: Style
STYLE_ENVIRONMENT: Style
ISOLATION_UNSPECIFIED: Isolation
ISOLATION_SAMPLE: Isolation
ISOLATION_WORKER: Isolation
ISOLATION_PROCESS: Isolation
STATUS_UNSPECIFIED: Status
STATUS_OK: Status
STATUS_ERROR: Status
STATUS_TIMEOUT: Status
STATUS_CRASH: Status
STATUS_INVALID: Status
STATUS_UNAVAILABLE: Status

class FunctionSource(_message.Message):
    __slots__ = ("name", "filename", "source", "function", "style", "workers", "concurrency", "max_log_bytes", "isolation", "warm", "args_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    STYLE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MAX_LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    filename: str
    source: str
    function: str
    style: Style
    workers: int
    concurrency: int
    max_log_bytes: int
    isolation: Isolation
    warm: int
    args_json: str
    def __init__(self, name: _Optional[str] = ..., filename: _Optional[str] = ..., source: _Optional[str] = ..., function: _Optional[str] = ..., style: _Optional[_Union[Style, str]] = ..., workers: _Optional[int] = ..., concurrency: _Optional[int] = ..., max_log_bytes: _Optional[int] = ..., isolation: _Optional[_Union[Isolation, str]] = ..., warm: _Optional[int] = ..., args_json: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("functions",)
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    functions: _containers.RepeatedCompositeFieldContainer[FunctionSource]
    def __init__(self, functions: _Optional[_Iterable[_Union[FunctionSource, _Mapping]]] = ...) -> None: ...

class FunctionInfo(_message.Message):
    __slots__ = ("name", "filename", "function", "style", "is_async", "signature", "source_sha256", "accepted_keywords", "accepts_var_keywords", "required_keywords")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    STYLE_FIELD_NUMBER: _ClassVar[int]
    IS_ASYNC_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SHA256_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_KEYWORDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_VAR_KEYWORDS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_KEYWORDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    filename: str
    function: str
    style: Style
    is_async: bool
    signature: str
    source_sha256: str
    accepted_keywords: _containers.RepeatedScalarFieldContainer[str]
    accepts_var_keywords: bool
    required_keywords: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., filename: _Optional[str] = ..., function: _Optional[str] = ..., style: _Optional[_Union[Style, str]] = ..., is_async: _Optional[bool] = ..., signature: _Optional[str] = ..., source_sha256: _Optional[str] = ..., accepted_keywords: _Optional[_Iterable[str]] = ..., accepts_var_keywords: _Optional[bool] = ..., required_keywords: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("functions",)
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    functions: _containers.RepeatedCompositeFieldContainer[FunctionInfo]
    def __init__(self, functions: _Optional[_Iterable[_Union[FunctionInfo, _Mapping]]] = ...) -> None: ...

class TrainerState(_message.Message):
    __slots__ = ("global_step", "max_steps", "epoch", "num_train_epochs", "logging_steps", "eval_steps", "save_steps", "train_batch_size", "num_input_tokens_seen", "total_flos", "best_metric", "best_global_step", "best_model_checkpoint", "is_local_process_zero", "is_world_process_zero", "is_hyper_param_search", "trial_name")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAIN_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    LOGGING_STEPS_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAVE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_INPUT_TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FLOS_FIELD_NUMBER: _ClassVar[int]
    BEST_METRIC_FIELD_NUMBER: _ClassVar[int]
    BEST_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    BEST_MODEL_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    IS_LOCAL_PROCESS_ZERO_FIELD_NUMBER: _ClassVar[int]
    IS_WORLD_PROCESS_ZERO_FIELD_NUMBER: _ClassVar[int]
    IS_HYPER_PARAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    TRIAL_NAME_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    max_steps: int
    epoch: float
    num_train_epochs: int
    logging_steps: int
    eval_steps: int
    save_steps: int
    train_batch_size: int
    num_input_tokens_seen: int
    total_flos: float
    best_metric: float
    best_global_step: int
    best_model_checkpoint: str
    is_local_process_zero: bool
    is_world_process_zero: bool
    is_hyper_param_search: bool
    trial_name: str
    def __init__(self, global_step: _Optional[int] = ..., max_steps: _Optional[int] = ..., epoch: _Optional[float] = ..., num_train_epochs: _Optional[int] = ..., logging_steps: _Optional[int] = ..., eval_steps: _Optional[int] = ..., save_steps: _Optional[int] = ..., train_batch_size: _Optional[int] = ..., num_input_tokens_seen: _Optional[int] = ..., total_flos: _Optional[float] = ..., best_metric: _Optional[float] = ..., best_global_step: _Optional[int] = ..., best_model_checkpoint: _Optional[str] = ..., is_local_process_zero: _Optional[bool] = ..., is_world_process_zero: _Optional[bool] = ..., is_hyper_param_search: _Optional[bool] = ..., trial_name: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt", "completion", "prompt_messages_json", "completion_messages_json", "columns_json", "completion_ids", "has_completion_ids")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_JSON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    completion: str
    prompt_messages_json: str
    completion_messages_json: str
    columns_json: str
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    has_completion_ids: bool
    def __init__(self, prompt: _Optional[str] = ..., completion: _Optional[str] = ..., prompt_messages_json: _Optional[str] = ..., completion_messages_json: _Optional[str] = ..., columns_json: _Optional[str] = ..., completion_ids: _Optional[_Iterable[int]] = ..., has_completion_ids: _Optional[bool] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("function", "samples", "trainer_state", "has_trainer_state", "timeout_s", "sample_details", "episode", "episode_start", "episode_end")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STATE_FIELD_NUMBER: _ClassVar[int]
    HAS_TRAINER_STATE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_DETAILS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    EPISODE_START_FIELD_NUMBER: _ClassVar[int]
    EPISODE_END_FIELD_NUMBER: _ClassVar[int]
    function: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    trainer_state: TrainerState
    has_trainer_state: bool
    timeout_s: float
    sample_details: bool
    episode: str
    episode_start: bool
    episode_end: str
    def __init__(self, function: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., trainer_state: _Optional[_Union[TrainerState, _Mapping]] = ..., has_trainer_state: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., sample_details: _Optional[bool] = ..., episode: _Optional[str] = ..., episode_start: _Optional[bool] = ..., episode_end: _Optional[str] = ...) -> None: ...

class Score(_message.Message):
    __slots__ = ("value", "status", "error", "deferred", "logs", "seconds", "result_json")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    LOGS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    value: float
    status: Status
    error: str
    deferred: bool
    logs: str
    seconds: float
    result_json: str
    def __init__(self, value: _Optional[float] = ..., status: _Optional[_Union[Status, str]] = ..., error: _Optional[str] = ..., deferred: _Optional[bool] = ..., logs: _Optional[str] = ..., seconds: _Optional[float] = ..., result_json: _Optional[str] = ...) -> None: ...

class Metrics(_message.Message):
    __slots__ = ("elapsed_ms", "workers_replaced", "isolated_reruns")
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    ISOLATED_RERUNS_FIELD_NUMBER: _ClassVar[int]
    elapsed_ms: float
    workers_replaced: int
    isolated_reruns: int
    def __init__(self, elapsed_ms: _Optional[float] = ..., workers_replaced: _Optional[int] = ..., isolated_reruns: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "logs", "logs_truncated", "metrics", "logs_in_scores")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    LOGS_FIELD_NUMBER: _ClassVar[int]
    LOGS_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOGS_IN_SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[Score]
    logs: str
    logs_truncated: bool
    metrics: Metrics
    logs_in_scores: bool
    def __init__(self, scores: _Optional[_Iterable[_Union[Score, _Mapping]]] = ..., logs: _Optional[str] = ..., logs_truncated: _Optional[bool] = ..., metrics: _Optional[_Union[Metrics, _Mapping]] = ..., logs_in_scores: _Optional[bool] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("server_version", "python_version", "platform", "functions", "packages")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    python_version: str
    platform: str
    functions: _containers.RepeatedCompositeFieldContainer[FunctionInfo]
    packages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, server_version: _Optional[str] = ..., python_version: _Optional[str] = ..., platform: _Optional[str] = ..., functions: _Optional[_Iterable[_Union[FunctionInfo, _Mapping]]] = ..., packages: _Optional[_Iterable[str]] = ...) -> None: ...
