from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_INDEXING: _ClassVar[JobState]
    JOB_STATE_READY: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
DTYPE_UNSPECIFIED: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_UINT16: DType
DTYPE_UINT8: DType
DTYPE_FLOAT32: DType
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_INDEXING: JobState
JOB_STATE_READY: JobState
JOB_STATE_FAILED: JobState

class GetBatchRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "world_size")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    world_size: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class StreamBatchesRequest(_message.Message):
    __slots__ = ("job", "start_step", "end_step", "rank", "world_size")
    JOB_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    END_STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job: str
    start_step: int
    end_step: int
    rank: int
    world_size: int
    def __init__(self, job: _Optional[str] = ..., start_step: _Optional[int] = ..., end_step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("job", "step", "rank", "world_size", "fingerprint", "epoch", "job_fingerprint", "wire_version", "rows", "seq_len", "token_dtype", "tokens", "starts", "row_splits", "padding", "plan_phase_start", "plan_fingerprint", "plan_version")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    JOB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    ROW_SPLITS_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    PLAN_PHASE_START_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    world_size: int
    fingerprint: str
    epoch: int
    job_fingerprint: str
    wire_version: int
    rows: int
    seq_len: int
    token_dtype: DType
    tokens: bytes
    starts: bytes
    row_splits: bytes
    padding: bytes
    plan_phase_start: int
    plan_fingerprint: str
    plan_version: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., fingerprint: _Optional[str] = ..., epoch: _Optional[int] = ..., job_fingerprint: _Optional[str] = ..., wire_version: _Optional[int] = ..., rows: _Optional[int] = ..., seq_len: _Optional[int] = ..., token_dtype: _Optional[_Union[DType, str]] = ..., tokens: _Optional[bytes] = ..., starts: _Optional[bytes] = ..., row_splits: _Optional[bytes] = ..., padding: _Optional[bytes] = ..., plan_phase_start: _Optional[int] = ..., plan_fingerprint: _Optional[str] = ..., plan_version: _Optional[int] = ...) -> None: ...

class DescribeJobRequest(_message.Message):
    __slots__ = ("job", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class BadRecordCount(_message.Message):
    __slots__ = ("reason", "count")
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    count: int
    def __init__(self, reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("name", "fingerprint", "state", "error", "seq_len", "global_batch_size", "seed", "packing", "num_sources", "num_chunks", "chunks_indexed", "num_documents", "num_tokens", "rows_per_epoch", "steps_per_epoch", "bad_records", "tensor_names", "datasets", "schedule", "plan")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    NUM_SOURCES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_INDEXED_FIELD_NUMBER: _ClassVar[int]
    NUM_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BAD_RECORDS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    state: JobState
    error: str
    seq_len: int
    global_batch_size: int
    seed: int
    packing: str
    num_sources: int
    num_chunks: int
    chunks_indexed: int
    num_documents: int
    num_tokens: int
    rows_per_epoch: int
    steps_per_epoch: int
    bad_records: _containers.RepeatedCompositeFieldContainer[BadRecordCount]
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    schedule: _containers.RepeatedCompositeFieldContainer[Phase]
    plan: PlanInfo
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., error: _Optional[str] = ..., seq_len: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., packing: _Optional[str] = ..., num_sources: _Optional[int] = ..., num_chunks: _Optional[int] = ..., chunks_indexed: _Optional[int] = ..., num_documents: _Optional[int] = ..., num_tokens: _Optional[int] = ..., rows_per_epoch: _Optional[int] = ..., steps_per_epoch: _Optional[int] = ..., bad_records: _Optional[_Iterable[_Union[BadRecordCount, _Mapping]]] = ..., tensor_names: _Optional[_Iterable[str]] = ..., datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ..., schedule: _Optional[_Iterable[_Union[Phase, _Mapping]]] = ..., plan: _Optional[_Union[PlanInfo, _Mapping]] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "weight", "fingerprint", "num_sources", "num_chunks", "chunks_indexed", "num_documents", "num_tokens", "rows_per_epoch")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_SOURCES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_INDEXED_FIELD_NUMBER: _ClassVar[int]
    NUM_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: str
    fingerprint: str
    num_sources: int
    num_chunks: int
    chunks_indexed: int
    num_documents: int
    num_tokens: int
    rows_per_epoch: int
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[str] = ..., fingerprint: _Optional[str] = ..., num_sources: _Optional[int] = ..., num_chunks: _Optional[int] = ..., chunks_indexed: _Optional[int] = ..., num_documents: _Optional[int] = ..., num_tokens: _Optional[int] = ..., rows_per_epoch: _Optional[int] = ...) -> None: ...

class Phase(_message.Message):
    __slots__ = ("start_step", "global_batch_size", "weights")
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    start_step: int
    global_batch_size: int
    weights: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, start_step: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., weights: _Optional[_Iterable[str]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("source", "record", "token_start", "token_end", "row_start", "row_end")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    source: str
    record: str
    token_start: int
    token_end: int
    row_start: int
    row_end: int
    def __init__(self, source: _Optional[str] = ..., record: _Optional[str] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ...) -> None: ...

class RowExplanation(_message.Message):
    __slots__ = ("row", "dataset", "epoch", "pieces", "dataset_row")
    ROW_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    DATASET_ROW_FIELD_NUMBER: _ClassVar[int]
    row: int
    dataset: str
    epoch: int
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    dataset_row: int
    def __init__(self, row: _Optional[int] = ..., dataset: _Optional[str] = ..., epoch: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ..., dataset_row: _Optional[int] = ...) -> None: ...

class Explanation(_message.Message):
    __slots__ = ("job", "step", "rank", "world_size", "rows", "fingerprint")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    world_size: int
    rows: _containers.RepeatedCompositeFieldContainer[RowExplanation]
    fingerprint: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[RowExplanation, _Mapping]]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("job", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class PlanPhase(_message.Message):
    __slots__ = ("start_step", "global_batch_size", "seq_len", "datasets", "weights", "fingerprint", "packing")
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    start_step: int
    global_batch_size: int
    seq_len: int
    datasets: _containers.RepeatedScalarFieldContainer[str]
    weights: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: str
    packing: str
    def __init__(self, start_step: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., seq_len: _Optional[int] = ..., datasets: _Optional[_Iterable[str]] = ..., weights: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[str] = ..., packing: _Optional[str] = ...) -> None: ...

class DatasetConsumption(_message.Message):
    __slots__ = ("dataset", "rows", "tokens")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    rows: int
    tokens: int
    def __init__(self, dataset: _Optional[str] = ..., rows: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class PlanInfo(_message.Message):
    __slots__ = ("job", "version", "horizon", "served", "phases", "log", "step", "phase", "consumed", "replaced")
    JOB_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    job: str
    version: int
    horizon: int
    served: int
    phases: _containers.RepeatedCompositeFieldContainer[PlanPhase]
    log: str
    step: int
    phase: int
    consumed: _containers.RepeatedCompositeFieldContainer[DatasetConsumption]
    replaced: _containers.RepeatedCompositeFieldContainer[PlanPhase]
    def __init__(self, job: _Optional[str] = ..., version: _Optional[int] = ..., horizon: _Optional[int] = ..., served: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[PlanPhase, _Mapping]]] = ..., log: _Optional[str] = ..., step: _Optional[int] = ..., phase: _Optional[int] = ..., consumed: _Optional[_Iterable[_Union[DatasetConsumption, _Mapping]]] = ..., replaced: _Optional[_Iterable[_Union[PlanPhase, _Mapping]]] = ...) -> None: ...

class DatasetWeight(_message.Message):
    __slots__ = ("dataset", "weight")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    weight: str
    def __init__(self, dataset: _Optional[str] = ..., weight: _Optional[str] = ...) -> None: ...

class NewDatasetSource(_message.Message):
    __slots__ = ("path", "format", "text_field", "token_field")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_FIELD_NUMBER: _ClassVar[int]
    path: str
    format: str
    text_field: str
    token_field: str
    def __init__(self, path: _Optional[str] = ..., format: _Optional[str] = ..., text_field: _Optional[str] = ..., token_field: _Optional[str] = ...) -> None: ...

class NewDataset(_message.Message):
    __slots__ = ("name", "sources", "chunk_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    sources: _containers.RepeatedCompositeFieldContainer[NewDatasetSource]
    chunk_bytes: int
    def __init__(self, name: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[NewDatasetSource, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class AmendPlanRequest(_message.Message):
    __slots__ = ("job", "start_step", "global_batch_size", "seq_len", "weights", "add", "expected_version", "packing")
    JOB_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    job: str
    start_step: int
    global_batch_size: int
    seq_len: int
    weights: _containers.RepeatedCompositeFieldContainer[DatasetWeight]
    add: _containers.RepeatedCompositeFieldContainer[NewDataset]
    expected_version: int
    packing: str
    def __init__(self, job: _Optional[str] = ..., start_step: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., seq_len: _Optional[int] = ..., weights: _Optional[_Iterable[_Union[DatasetWeight, _Mapping]]] = ..., add: _Optional[_Iterable[_Union[NewDataset, _Mapping]]] = ..., expected_version: _Optional[int] = ..., packing: _Optional[str] = ...) -> None: ...
