from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_KIND_UNSPECIFIED: _ClassVar[DeviceKind]
    DEVICE_KIND_CPU: _ClassVar[DeviceKind]
    DEVICE_KIND_CUDA: _ClassVar[DeviceKind]

class AgentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_STATE_UNSPECIFIED: _ClassVar[AgentState]
    AGENT_STATE_IDLE: _ClassVar[AgentState]
    AGENT_STATE_TRAINING: _ClassVar[AgentState]
    AGENT_STATE_PROFILING: _ClassVar[AgentState]

class MovePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MOVE_PHASE_UNSPECIFIED: _ClassVar[MovePhase]
    MOVE_PHASE_HOLD: _ClassVar[MovePhase]
    MOVE_PHASE_GO: _ClassVar[MovePhase]
    MOVE_PHASE_CANCEL: _ClassVar[MovePhase]

class Schedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_UNSPECIFIED: _ClassVar[Schedule]
    SCHEDULE_1F1B: _ClassVar[Schedule]
    SCHEDULE_GPIPE: _ClassVar[Schedule]
    SCHEDULE_ZB_H1: _ClassVar[Schedule]
    SCHEDULE_ZB_H2: _ClassVar[Schedule]
    SCHEDULE_INTERLEAVED_1F1B: _ClassVar[Schedule]
    SCHEDULE_ZB_V: _ClassVar[Schedule]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_NONE: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_INT4_ROTATED: _ClassVar[Codec]
DEVICE_KIND_UNSPECIFIED: DeviceKind
DEVICE_KIND_CPU: DeviceKind
DEVICE_KIND_CUDA: DeviceKind
AGENT_STATE_UNSPECIFIED: AgentState
AGENT_STATE_IDLE: AgentState
AGENT_STATE_TRAINING: AgentState
AGENT_STATE_PROFILING: AgentState
MOVE_PHASE_UNSPECIFIED: MovePhase
MOVE_PHASE_HOLD: MovePhase
MOVE_PHASE_GO: MovePhase
MOVE_PHASE_CANCEL: MovePhase
SCHEDULE_UNSPECIFIED: Schedule
SCHEDULE_1F1B: Schedule
SCHEDULE_GPIPE: Schedule
SCHEDULE_ZB_H1: Schedule
SCHEDULE_ZB_H2: Schedule
SCHEDULE_INTERLEAVED_1F1B: Schedule
SCHEDULE_ZB_V: Schedule
CODEC_UNSPECIFIED: Codec
CODEC_NONE: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
CODEC_INT4_ROTATED: Codec

class StoreRequest(_message.Message):
    __slots__ = ("op", "keys", "value", "expected", "amount", "timeout_s", "agent_id")
    OP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    op: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    timeout_s: float
    agent_id: str
    def __init__(self, op: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., timeout_s: _Optional[float] = ..., agent_id: _Optional[str] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("ok", "value", "number")
    OK_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    value: bytes
    number: int
    def __init__(self, ok: _Optional[bool] = ..., value: _Optional[bytes] = ..., number: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "state", "step", "silent_s")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SILENT_S_FIELD_NUMBER: _ClassVar[int]
    node: str
    state: str
    step: int
    silent_s: float
    def __init__(self, node: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., silent_s: _Optional[float] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("generation", "nodes", "down_requested")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    DOWN_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    down_requested: str
    def __init__(self, generation: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., down_requested: _Optional[str] = ...) -> None: ...

class DownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class DownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Device(_message.Message):
    __slots__ = ("kind", "name", "memory_bytes", "index", "uuid")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    kind: DeviceKind
    name: str
    memory_bytes: int
    index: int
    uuid: str
    def __init__(self, kind: _Optional[_Union[DeviceKind, str]] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., index: _Optional[int] = ..., uuid: _Optional[str] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("node_name", "hostname", "devices", "agent_version", "torch_version", "pid", "region", "labels", "cpu_count")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    hostname: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    agent_version: str
    torch_version: str
    pid: int
    region: str
    labels: _containers.ScalarMap[str, str]
    cpu_count: int
    def __init__(self, node_name: _Optional[str] = ..., hostname: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., agent_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., pid: _Optional[int] = ..., region: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., cpu_count: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: AgentInfo
    def __init__(self, agent: _Optional[_Union[AgentInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("agent_id", "heartbeat_interval_ms")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    heartbeat_interval_ms: int
    def __init__(self, agent_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("agent_id", "state", "step", "has_clock", "clock_offset_s", "clock_rtt_s")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_CLOCK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_S_FIELD_NUMBER: _ClassVar[int]
    CLOCK_RTT_S_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    state: AgentState
    step: int
    has_clock: bool
    clock_offset_s: float
    clock_rtt_s: float
    def __init__(self, agent_id: _Optional[str] = ..., state: _Optional[_Union[AgentState, str]] = ..., step: _Optional[int] = ..., has_clock: _Optional[bool] = ..., clock_offset_s: _Optional[float] = ..., clock_rtt_s: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("coordinator_time",)
    COORDINATOR_TIME_FIELD_NUMBER: _ClassVar[int]
    coordinator_time: float
    def __init__(self, coordinator_time: _Optional[float] = ...) -> None: ...

class WatchCommandsRequest(_message.Message):
    __slots__ = ("agent_id",)
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    def __init__(self, agent_id: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("run_stage", "shutdown", "profile", "abort", "move", "generation")
    RUN_STAGE_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    run_stage: RunStage
    shutdown: Shutdown
    profile: Profile
    abort: Abort
    move: Move
    generation: int
    def __init__(self, run_stage: _Optional[_Union[RunStage, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., profile: _Optional[_Union[Profile, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., move: _Optional[_Union[Move, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("reason", "snapshot_dir", "link_probe")
    REASON_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    LINK_PROBE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    snapshot_dir: str
    link_probe: bool
    def __init__(self, reason: _Optional[str] = ..., snapshot_dir: _Optional[str] = ..., link_probe: _Optional[bool] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("id", "phase", "at_step", "stage", "layout", "data_parallel")
    ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    phase: MovePhase
    at_step: int
    stage: StageSpec
    layout: _containers.RepeatedCompositeFieldContainer[StagePlace]
    data_parallel: DataParallel
    def __init__(self, id: _Optional[int] = ..., phase: _Optional[_Union[MovePhase, str]] = ..., at_step: _Optional[int] = ..., stage: _Optional[_Union[StageSpec, _Mapping]] = ..., layout: _Optional[_Iterable[_Union[StagePlace, _Mapping]]] = ..., data_parallel: _Optional[_Union[DataParallel, _Mapping]] = ...) -> None: ...

class MoveReport(_message.Message):
    __slots__ = ("id", "phase", "step", "ok", "error", "bytes_sent", "bytes_received", "seconds", "layer_start", "layer_end")
    ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    id: int
    phase: MovePhase
    step: int
    ok: bool
    error: str
    bytes_sent: int
    bytes_received: int
    seconds: float
    layer_start: int
    layer_end: int
    def __init__(self, id: _Optional[int] = ..., phase: _Optional[_Union[MovePhase, str]] = ..., step: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class ReportMoveRequest(_message.Message):
    __slots__ = ("agent_id", "generation", "report")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    generation: int
    report: MoveReport
    def __init__(self, agent_id: _Optional[str] = ..., generation: _Optional[int] = ..., report: _Optional[_Union[MoveReport, _Mapping]] = ...) -> None: ...

class ReportMoveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GptModel(_message.Message):
    __slots__ = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    D_FF_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    def __init__(self, vocab_size: _Optional[int] = ..., seq_len: _Optional[int] = ..., d_model: _Optional[int] = ..., n_layers: _Optional[int] = ..., n_heads: _Optional[int] = ..., d_ff: _Optional[int] = ...) -> None: ...

class EntrypointModel(_message.Message):
    __slots__ = ("entrypoint", "kwargs", "seq_len")
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    entrypoint: str
    kwargs: _struct_pb2.Struct
    seq_len: int
    def __init__(self, entrypoint: _Optional[str] = ..., kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., seq_len: _Optional[int] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("gpt", "entrypoint")
    GPT_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    gpt: GptModel
    entrypoint: EntrypointModel
    def __init__(self, gpt: _Optional[_Union[GptModel, _Mapping]] = ..., entrypoint: _Optional[_Union[EntrypointModel, _Mapping]] = ...) -> None: ...

class DataSpec(_message.Message):
    __slots__ = ("path", "seed", "format", "dtype", "eval_fraction")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EVAL_FRACTION_FIELD_NUMBER: _ClassVar[int]
    path: str
    seed: int
    format: str
    dtype: str
    eval_fraction: float
    def __init__(self, path: _Optional[str] = ..., seed: _Optional[int] = ..., format: _Optional[str] = ..., dtype: _Optional[str] = ..., eval_fraction: _Optional[float] = ...) -> None: ...

class TrainSpec(_message.Message):
    __slots__ = ("steps", "micro_batch_size", "num_microbatches", "schedule", "lr", "weight_decay", "seed", "checkpoint_dir", "checkpoint_every", "save_part", "start_step", "upload_parts", "snapshot_dir", "optimizer", "momentum", "lr_schedule", "warmup_steps", "min_lr_ratio", "grad_clip", "eval_every", "eval_microbatches", "precision", "trace_every", "watchdog_s", "first_step_watchdog_s", "eval_before_start", "link_rounding")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    SAVE_PART_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_PARTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    TRACE_EVERY_FIELD_NUMBER: _ClassVar[int]
    WATCHDOG_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_WATCHDOG_S_FIELD_NUMBER: _ClassVar[int]
    EVAL_BEFORE_START_FIELD_NUMBER: _ClassVar[int]
    LINK_ROUNDING_FIELD_NUMBER: _ClassVar[int]
    steps: int
    micro_batch_size: int
    num_microbatches: int
    schedule: Schedule
    lr: float
    weight_decay: float
    seed: int
    checkpoint_dir: str
    checkpoint_every: int
    save_part: bool
    start_step: int
    upload_parts: bool
    snapshot_dir: str
    optimizer: str
    momentum: float
    lr_schedule: str
    warmup_steps: int
    min_lr_ratio: float
    grad_clip: float
    eval_every: int
    eval_microbatches: int
    precision: str
    trace_every: int
    watchdog_s: float
    first_step_watchdog_s: float
    eval_before_start: bool
    link_rounding: str
    def __init__(self, steps: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., num_microbatches: _Optional[int] = ..., schedule: _Optional[_Union[Schedule, str]] = ..., lr: _Optional[float] = ..., weight_decay: _Optional[float] = ..., seed: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., checkpoint_every: _Optional[int] = ..., save_part: _Optional[bool] = ..., start_step: _Optional[int] = ..., upload_parts: _Optional[bool] = ..., snapshot_dir: _Optional[str] = ..., optimizer: _Optional[str] = ..., momentum: _Optional[float] = ..., lr_schedule: _Optional[str] = ..., warmup_steps: _Optional[int] = ..., min_lr_ratio: _Optional[float] = ..., grad_clip: _Optional[float] = ..., eval_every: _Optional[int] = ..., eval_microbatches: _Optional[int] = ..., precision: _Optional[str] = ..., trace_every: _Optional[int] = ..., watchdog_s: _Optional[float] = ..., first_step_watchdog_s: _Optional[float] = ..., eval_before_start: _Optional[bool] = ..., link_rounding: _Optional[str] = ...) -> None: ...

class RestoreSpec(_message.Message):
    __slots__ = ("checkpoint_dir",)
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    checkpoint_dir: str
    def __init__(self, checkpoint_dir: _Optional[str] = ...) -> None: ...

class Emulation(_message.Message):
    __slots__ = ("speed", "memory_gb", "speed_changes")
    SPEED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    SPEED_CHANGES_FIELD_NUMBER: _ClassVar[int]
    speed: float
    memory_gb: float
    speed_changes: _containers.RepeatedCompositeFieldContainer[SpeedChange]
    def __init__(self, speed: _Optional[float] = ..., memory_gb: _Optional[float] = ..., speed_changes: _Optional[_Iterable[_Union[SpeedChange, _Mapping]]] = ...) -> None: ...

class SpeedChange(_message.Message):
    __slots__ = ("at_step", "speed")
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    at_step: int
    speed: float
    def __init__(self, at_step: _Optional[int] = ..., speed: _Optional[float] = ...) -> None: ...

class LinkSpec(_message.Message):
    __slots__ = ("peer_rank", "forward_codec", "backward_codec", "emulate_bandwidth_mbps", "emulate_latency_ms", "max_message_bytes", "bandwidth_changes", "sealed")
    PEER_RANK_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CODEC_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_CODEC_FIELD_NUMBER: _ClassVar[int]
    EMULATE_BANDWIDTH_MBPS_FIELD_NUMBER: _ClassVar[int]
    EMULATE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_CHANGES_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    peer_rank: int
    forward_codec: Codec
    backward_codec: Codec
    emulate_bandwidth_mbps: float
    emulate_latency_ms: float
    max_message_bytes: int
    bandwidth_changes: _containers.RepeatedCompositeFieldContainer[BandwidthChange]
    sealed: bool
    def __init__(self, peer_rank: _Optional[int] = ..., forward_codec: _Optional[_Union[Codec, str]] = ..., backward_codec: _Optional[_Union[Codec, str]] = ..., emulate_bandwidth_mbps: _Optional[float] = ..., emulate_latency_ms: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., bandwidth_changes: _Optional[_Iterable[_Union[BandwidthChange, _Mapping]]] = ..., sealed: _Optional[bool] = ...) -> None: ...

class BandwidthChange(_message.Message):
    __slots__ = ("at_step", "bandwidth_mbps")
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_MBPS_FIELD_NUMBER: _ClassVar[int]
    at_step: int
    bandwidth_mbps: float
    def __init__(self, at_step: _Optional[int] = ..., bandwidth_mbps: _Optional[float] = ...) -> None: ...

class StageSpec(_message.Message):
    __slots__ = ("stage_index", "num_stages", "layer_start", "layer_end", "prev", "next", "device", "threads", "emulate", "memory_fraction", "window", "eval_fill", "parts", "device_index", "num_devices", "device_order")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PREV_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    EMULATE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    EVAL_FILL_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ORDER_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int
    prev: LinkSpec
    next: LinkSpec
    device: str
    threads: int
    emulate: Emulation
    memory_fraction: float
    window: int
    eval_fill: str
    parts: _containers.RepeatedCompositeFieldContainer[StagePartSpec]
    device_index: int
    num_devices: int
    device_order: str
    def __init__(self, stage_index: _Optional[int] = ..., num_stages: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., prev: _Optional[_Union[LinkSpec, _Mapping]] = ..., next: _Optional[_Union[LinkSpec, _Mapping]] = ..., device: _Optional[str] = ..., threads: _Optional[int] = ..., emulate: _Optional[_Union[Emulation, _Mapping]] = ..., memory_fraction: _Optional[float] = ..., window: _Optional[int] = ..., eval_fill: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[StagePartSpec, _Mapping]]] = ..., device_index: _Optional[int] = ..., num_devices: _Optional[int] = ..., device_order: _Optional[str] = ...) -> None: ...

class StagePartSpec(_message.Message):
    __slots__ = ("stage_index", "layer_start", "layer_end", "prev", "next")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PREV_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    layer_start: int
    layer_end: int
    prev: LinkSpec
    next: LinkSpec
    def __init__(self, stage_index: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., prev: _Optional[_Union[LinkSpec, _Mapping]] = ..., next: _Optional[_Union[LinkSpec, _Mapping]] = ...) -> None: ...

class Rendezvous(_message.Message):
    __slots__ = ("generation", "rank", "world_size", "timeout_s", "backend", "interface", "port_low", "port_high", "data_plane_encrypt", "data_plane_private_key", "data_plane_public_keys")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_FIELD_NUMBER: _ClassVar[int]
    PORT_LOW_FIELD_NUMBER: _ClassVar[int]
    PORT_HIGH_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ENCRYPT_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_PRIVATE_KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_PUBLIC_KEYS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    world_size: int
    timeout_s: float
    backend: str
    interface: str
    port_low: int
    port_high: int
    data_plane_encrypt: str
    data_plane_private_key: bytes
    data_plane_public_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., timeout_s: _Optional[float] = ..., backend: _Optional[str] = ..., interface: _Optional[str] = ..., port_low: _Optional[int] = ..., port_high: _Optional[int] = ..., data_plane_encrypt: _Optional[str] = ..., data_plane_private_key: _Optional[bytes] = ..., data_plane_public_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SyncGroupSpec(_message.Message):
    __slots__ = ("layer_start", "layer_end", "ranks", "codec", "emulate_bandwidth_mbps", "emulate_latency_ms", "region_of")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    EMULATE_BANDWIDTH_MBPS_FIELD_NUMBER: _ClassVar[int]
    EMULATE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    REGION_OF_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    emulate_bandwidth_mbps: float
    emulate_latency_ms: float
    region_of: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[Codec, str]] = ..., emulate_bandwidth_mbps: _Optional[float] = ..., emulate_latency_ms: _Optional[float] = ..., region_of: _Optional[_Iterable[int]] = ...) -> None: ...

class DataParallel(_message.Message):
    __slots__ = ("pipeline_index", "microbatch_offset", "global_microbatches", "sync_groups", "pipeline_sizes", "island_microbatches", "islands", "island_index", "outer", "pipeline_microbatches")
    PIPELINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SYNC_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_SIZES_FIELD_NUMBER: _ClassVar[int]
    ISLAND_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    ISLAND_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    pipeline_index: int
    microbatch_offset: int
    global_microbatches: int
    sync_groups: _containers.RepeatedCompositeFieldContainer[SyncGroupSpec]
    pipeline_sizes: _containers.RepeatedScalarFieldContainer[int]
    island_microbatches: int
    islands: _containers.RepeatedCompositeFieldContainer[IslandRanks]
    island_index: int
    outer: OuterSpec
    pipeline_microbatches: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pipeline_index: _Optional[int] = ..., microbatch_offset: _Optional[int] = ..., global_microbatches: _Optional[int] = ..., sync_groups: _Optional[_Iterable[_Union[SyncGroupSpec, _Mapping]]] = ..., pipeline_sizes: _Optional[_Iterable[int]] = ..., island_microbatches: _Optional[int] = ..., islands: _Optional[_Iterable[_Union[IslandRanks, _Mapping]]] = ..., island_index: _Optional[int] = ..., outer: _Optional[_Union[OuterSpec, _Mapping]] = ..., pipeline_microbatches: _Optional[_Iterable[int]] = ...) -> None: ...

class IslandRanks(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class OuterSpec(_message.Message):
    __slots__ = ("every", "lr", "momentum", "fragments", "delay", "alpha", "groups")
    EVERY_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    DELAY_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    every: int
    lr: float
    momentum: float
    fragments: int
    delay: int
    alpha: float
    groups: _containers.RepeatedCompositeFieldContainer[SyncGroupSpec]
    def __init__(self, every: _Optional[int] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., fragments: _Optional[int] = ..., delay: _Optional[int] = ..., alpha: _Optional[float] = ..., groups: _Optional[_Iterable[_Union[SyncGroupSpec, _Mapping]]] = ...) -> None: ...

class RunStage(_message.Message):
    __slots__ = ("model", "data", "train", "stage", "rendezvous", "data_parallel", "restore", "layout")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    model: ModelSpec
    data: DataSpec
    train: TrainSpec
    stage: StageSpec
    rendezvous: Rendezvous
    data_parallel: DataParallel
    restore: RestoreSpec
    layout: _containers.RepeatedCompositeFieldContainer[StagePlace]
    def __init__(self, model: _Optional[_Union[ModelSpec, _Mapping]] = ..., data: _Optional[_Union[DataSpec, _Mapping]] = ..., train: _Optional[_Union[TrainSpec, _Mapping]] = ..., stage: _Optional[_Union[StageSpec, _Mapping]] = ..., rendezvous: _Optional[_Union[Rendezvous, _Mapping]] = ..., data_parallel: _Optional[_Union[DataParallel, _Mapping]] = ..., restore: _Optional[_Union[RestoreSpec, _Mapping]] = ..., layout: _Optional[_Iterable[_Union[StagePlace, _Mapping]]] = ...) -> None: ...

class StagePlace(_message.Message):
    __slots__ = ("rank", "pipeline", "layer_start", "layer_end", "region", "node")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pipeline: int
    layer_start: int
    layer_end: int
    region: str
    node: str
    def __init__(self, rank: _Optional[int] = ..., pipeline: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., region: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "stage_index", "has_loss", "loss", "step_s", "compute_s", "comm_s", "tokens", "forward_raw_bytes", "forward_wire_bytes", "backward_raw_bytes", "backward_wire_bytes", "pipeline_index", "sync_s", "sync_raw_bytes", "sync_wire_bytes", "lr", "grad_norm", "has_eval_loss", "eval_loss", "trace", "from_prev", "from_next", "outer_launched", "outer_applied", "outer_s", "outer_raw_bytes", "outer_wire_bytes", "peak_activation_bytes", "peak_used_bytes", "eval_follows", "eval_only", "parts")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    COMM_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SYNC_S_FIELD_NUMBER: _ClassVar[int]
    SYNC_RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    SYNC_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    HAS_EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    FROM_PREV_FIELD_NUMBER: _ClassVar[int]
    FROM_NEXT_FIELD_NUMBER: _ClassVar[int]
    OUTER_LAUNCHED_FIELD_NUMBER: _ClassVar[int]
    OUTER_APPLIED_FIELD_NUMBER: _ClassVar[int]
    OUTER_S_FIELD_NUMBER: _ClassVar[int]
    OUTER_RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTER_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVAL_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    EVAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    stage_index: int
    has_loss: bool
    loss: float
    step_s: float
    compute_s: float
    comm_s: float
    tokens: int
    forward_raw_bytes: int
    forward_wire_bytes: int
    backward_raw_bytes: int
    backward_wire_bytes: int
    pipeline_index: int
    sync_s: float
    sync_raw_bytes: int
    sync_wire_bytes: int
    lr: float
    grad_norm: float
    has_eval_loss: bool
    eval_loss: float
    trace: _containers.RepeatedCompositeFieldContainer[TraceEvent]
    from_prev: LinkTransit
    from_next: LinkTransit
    outer_launched: int
    outer_applied: int
    outer_s: float
    outer_raw_bytes: int
    outer_wire_bytes: int
    peak_activation_bytes: int
    peak_used_bytes: int
    eval_follows: bool
    eval_only: bool
    parts: _containers.RepeatedCompositeFieldContainer[PartStep]
    def __init__(self, step: _Optional[int] = ..., stage_index: _Optional[int] = ..., has_loss: _Optional[bool] = ..., loss: _Optional[float] = ..., step_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., comm_s: _Optional[float] = ..., tokens: _Optional[int] = ..., forward_raw_bytes: _Optional[int] = ..., forward_wire_bytes: _Optional[int] = ..., backward_raw_bytes: _Optional[int] = ..., backward_wire_bytes: _Optional[int] = ..., pipeline_index: _Optional[int] = ..., sync_s: _Optional[float] = ..., sync_raw_bytes: _Optional[int] = ..., sync_wire_bytes: _Optional[int] = ..., lr: _Optional[float] = ..., grad_norm: _Optional[float] = ..., has_eval_loss: _Optional[bool] = ..., eval_loss: _Optional[float] = ..., trace: _Optional[_Iterable[_Union[TraceEvent, _Mapping]]] = ..., from_prev: _Optional[_Union[LinkTransit, _Mapping]] = ..., from_next: _Optional[_Union[LinkTransit, _Mapping]] = ..., outer_launched: _Optional[int] = ..., outer_applied: _Optional[int] = ..., outer_s: _Optional[float] = ..., outer_raw_bytes: _Optional[int] = ..., outer_wire_bytes: _Optional[int] = ..., peak_activation_bytes: _Optional[int] = ..., peak_used_bytes: _Optional[int] = ..., eval_follows: _Optional[bool] = ..., eval_only: _Optional[bool] = ..., parts: _Optional[_Iterable[_Union[PartStep, _Mapping]]] = ...) -> None: ...

class PartStep(_message.Message):
    __slots__ = ("stage_index", "compute_s", "forward_raw_bytes", "forward_wire_bytes", "backward_raw_bytes", "backward_wire_bytes")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    compute_s: float
    forward_raw_bytes: int
    forward_wire_bytes: int
    backward_raw_bytes: int
    backward_wire_bytes: int
    def __init__(self, stage_index: _Optional[int] = ..., compute_s: _Optional[float] = ..., forward_raw_bytes: _Optional[int] = ..., forward_wire_bytes: _Optional[int] = ..., backward_raw_bytes: _Optional[int] = ..., backward_wire_bytes: _Optional[int] = ...) -> None: ...

class LinkTransit(_message.Message):
    __slots__ = ("seconds", "wire_bytes")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    wire_bytes: int
    def __init__(self, seconds: _Optional[float] = ..., wire_bytes: _Optional[int] = ...) -> None: ...

class TraceEvent(_message.Message):
    __slots__ = ("name", "start", "end", "microbatch")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: float
    end: float
    microbatch: int
    def __init__(self, name: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., microbatch: _Optional[int] = ...) -> None: ...

class ReportStepRequest(_message.Message):
    __slots__ = ("agent_id", "metrics", "generation", "more_metrics")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MORE_METRICS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    metrics: StepMetrics
    generation: int
    more_metrics: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    def __init__(self, agent_id: _Optional[str] = ..., metrics: _Optional[_Union[StepMetrics, _Mapping]] = ..., generation: _Optional[int] = ..., more_metrics: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ...) -> None: ...

class ReportStepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportResultRequest(_message.Message):
    __slots__ = ("agent_id", "ok", "error", "generation", "worker_died")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_DIED_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    ok: bool
    error: str
    generation: int
    worker_died: bool
    def __init__(self, agent_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., generation: _Optional[int] = ..., worker_died: _Optional[bool] = ...) -> None: ...

class ReportResultResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointPart(_message.Message):
    __slots__ = ("directory", "file", "layer_start", "layer_end", "bytes", "sha256", "step", "snapshot", "write_s", "stall_s", "error")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    WRITE_S_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    directory: str
    file: str
    layer_start: int
    layer_end: int
    bytes: int
    sha256: str
    step: int
    snapshot: bool
    write_s: float
    stall_s: float
    error: str
    def __init__(self, directory: _Optional[str] = ..., file: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., step: _Optional[int] = ..., snapshot: _Optional[bool] = ..., write_s: _Optional[float] = ..., stall_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ReportCheckpointRequest(_message.Message):
    __slots__ = ("agent_id", "part", "generation")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    part: CheckpointPart
    generation: int
    def __init__(self, agent_id: _Optional[str] = ..., part: _Optional[_Union[CheckpointPart, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class ReportCheckpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PartChunk(_message.Message):
    __slots__ = ("agent_id", "generation", "step", "snapshot", "file", "data")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    generation: int
    step: int
    snapshot: bool
    file: str
    data: bytes
    def __init__(self, agent_id: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., snapshot: _Optional[bool] = ..., file: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadPartResponse(_message.Message):
    __slots__ = ("directory", "bytes", "sha256")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    directory: str
    bytes: int
    sha256: str
    def __init__(self, directory: _Optional[str] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class DownloadPartRequest(_message.Message):
    __slots__ = ("agent_id", "checkpoint", "file")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    checkpoint: str
    file: str
    def __init__(self, agent_id: _Optional[str] = ..., checkpoint: _Optional[str] = ..., file: _Optional[str] = ...) -> None: ...

class ProbePeer(_message.Message):
    __slots__ = ("peer_rank", "peer_node", "initiator", "emulate_bandwidth_mbps", "emulate_latency_ms")
    PEER_RANK_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_FIELD_NUMBER: _ClassVar[int]
    INITIATOR_FIELD_NUMBER: _ClassVar[int]
    EMULATE_BANDWIDTH_MBPS_FIELD_NUMBER: _ClassVar[int]
    EMULATE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    peer_rank: int
    peer_node: str
    initiator: bool
    emulate_bandwidth_mbps: float
    emulate_latency_ms: float
    def __init__(self, peer_rank: _Optional[int] = ..., peer_node: _Optional[str] = ..., initiator: _Optional[bool] = ..., emulate_bandwidth_mbps: _Optional[float] = ..., emulate_latency_ms: _Optional[float] = ...) -> None: ...

class Profile(_message.Message):
    __slots__ = ("model", "micro_batch_size", "seed", "device", "threads", "emulate", "measure_layers", "rendezvous", "probes", "precision", "memory_fraction")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    EMULATE_FIELD_NUMBER: _ClassVar[int]
    MEASURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    model: ModelSpec
    micro_batch_size: int
    seed: int
    device: str
    threads: int
    emulate: Emulation
    measure_layers: bool
    rendezvous: Rendezvous
    probes: _containers.RepeatedCompositeFieldContainer[ProbePeer]
    precision: str
    memory_fraction: float
    def __init__(self, model: _Optional[_Union[ModelSpec, _Mapping]] = ..., micro_batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., device: _Optional[str] = ..., threads: _Optional[int] = ..., emulate: _Optional[_Union[Emulation, _Mapping]] = ..., measure_layers: _Optional[bool] = ..., rendezvous: _Optional[_Union[Rendezvous, _Mapping]] = ..., probes: _Optional[_Iterable[_Union[ProbePeer, _Mapping]]] = ..., precision: _Optional[str] = ..., memory_fraction: _Optional[float] = ...) -> None: ...

class LayerProfile(_message.Message):
    __slots__ = ("seconds", "optimizer_seconds", "param_bytes", "activation_bytes", "output_bytes", "input_grad_seconds", "weight_grad_seconds")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_GRAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_GRAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    optimizer_seconds: float
    param_bytes: int
    activation_bytes: int
    output_bytes: int
    input_grad_seconds: float
    weight_grad_seconds: float
    def __init__(self, seconds: _Optional[float] = ..., optimizer_seconds: _Optional[float] = ..., param_bytes: _Optional[int] = ..., activation_bytes: _Optional[int] = ..., output_bytes: _Optional[int] = ..., input_grad_seconds: _Optional[float] = ..., weight_grad_seconds: _Optional[float] = ...) -> None: ...

class LinkProbe(_message.Message):
    __slots__ = ("peer_node", "latency_s", "bandwidth_bytes_per_s")
    PEER_NODE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    peer_node: str
    latency_s: float
    bandwidth_bytes_per_s: float
    def __init__(self, peer_node: _Optional[str] = ..., latency_s: _Optional[float] = ..., bandwidth_bytes_per_s: _Optional[float] = ...) -> None: ...

class ReportProfileRequest(_message.Message):
    __slots__ = ("agent_id", "ok", "error", "device_name", "memory_bytes", "layers", "links", "codec_seconds_per_byte", "generation", "cpu_per_wall", "cipher_seconds_per_byte", "worker_died")
    class CodecSecondsPerByteEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    CODEC_SECONDS_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CPU_PER_WALL_FIELD_NUMBER: _ClassVar[int]
    CIPHER_SECONDS_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    WORKER_DIED_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    ok: bool
    error: str
    device_name: str
    memory_bytes: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerProfile]
    links: _containers.RepeatedCompositeFieldContainer[LinkProbe]
    codec_seconds_per_byte: _containers.ScalarMap[str, float]
    generation: int
    cpu_per_wall: float
    cipher_seconds_per_byte: float
    worker_died: bool
    def __init__(self, agent_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., device_name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerProfile, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkProbe, _Mapping]]] = ..., codec_seconds_per_byte: _Optional[_Mapping[str, float]] = ..., generation: _Optional[int] = ..., cpu_per_wall: _Optional[float] = ..., cipher_seconds_per_byte: _Optional[float] = ..., worker_died: _Optional[bool] = ...) -> None: ...

class ReportProfileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
