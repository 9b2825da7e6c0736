from hetlaunch.protos import control_pb2 as _control_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerTask(_message.Message):
    __slots__ = ("run_stage", "profile", "store", "clock_anchor")
    RUN_STAGE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_ANCHOR_FIELD_NUMBER: _ClassVar[int]
    run_stage: _control_pb2.RunStage
    profile: _control_pb2.Profile
    store: StoreAccess
    clock_anchor: float
    def __init__(self, run_stage: _Optional[_Union[_control_pb2.RunStage, _Mapping]] = ..., profile: _Optional[_Union[_control_pb2.Profile, _Mapping]] = ..., store: _Optional[_Union[StoreAccess, _Mapping]] = ..., clock_anchor: _Optional[float] = ...) -> None: ...

class StoreAccess(_message.Message):
    __slots__ = ("address", "token", "ca_pem", "cert_pem", "key_pem", "agent_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    KEY_PEM_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    token: str
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    agent_id: str
    def __init__(self, address: _Optional[str] = ..., token: _Optional[str] = ..., ca_pem: _Optional[bytes] = ..., cert_pem: _Optional[bytes] = ..., key_pem: _Optional[bytes] = ..., agent_id: _Optional[str] = ...) -> None: ...

class WorkerControl(_message.Message):
    __slots__ = ("snapshot_dir", "task", "move")
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    snapshot_dir: str
    task: WorkerTask
    move: _control_pb2.Move
    def __init__(self, snapshot_dir: _Optional[str] = ..., task: _Optional[_Union[WorkerTask, _Mapping]] = ..., move: _Optional[_Union[_control_pb2.Move, _Mapping]] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("step", "checkpoint", "profile", "done", "move")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    step: _control_pb2.StepMetrics
    checkpoint: _control_pb2.CheckpointPart
    profile: _control_pb2.ReportProfileRequest
    done: WorkerDone
    move: _control_pb2.MoveReport
    def __init__(self, step: _Optional[_Union[_control_pb2.StepMetrics, _Mapping]] = ..., checkpoint: _Optional[_Union[_control_pb2.CheckpointPart, _Mapping]] = ..., profile: _Optional[_Union[_control_pb2.ReportProfileRequest, _Mapping]] = ..., done: _Optional[_Union[WorkerDone, _Mapping]] = ..., move: _Optional[_Union[_control_pb2.MoveReport, _Mapping]] = ...) -> None: ...

class WorkerDone(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
