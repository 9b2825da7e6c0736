from hetlaunch.protos import control_pb2 as _control_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerTask(_message.Message):
    __slots__ = ("run_stage", "profile")
    RUN_STAGE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    run_stage: _control_pb2.RunStage
    profile: _control_pb2.Profile
    def __init__(self, run_stage: _Optional[_Union[_control_pb2.RunStage, _Mapping]] = ..., profile: _Optional[_Union[_control_pb2.Profile, _Mapping]] = ...) -> None: ...

class WorkerControl(_message.Message):
    __slots__ = ("snapshot_dir", "task")
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    snapshot_dir: str
    task: WorkerTask
    def __init__(self, snapshot_dir: _Optional[str] = ..., task: _Optional[_Union[WorkerTask, _Mapping]] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("step", "checkpoint", "profile", "done")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    step: _control_pb2.StepMetrics
    checkpoint: _control_pb2.CheckpointPart
    profile: _control_pb2.ReportProfileRequest
    done: WorkerDone
    def __init__(self, step: _Optional[_Union[_control_pb2.StepMetrics, _Mapping]] = ..., checkpoint: _Optional[_Union[_control_pb2.CheckpointPart, _Mapping]] = ..., profile: _Optional[_Union[_control_pb2.ReportProfileRequest, _Mapping]] = ..., done: _Optional[_Union[WorkerDone, _Mapping]] = ...) -> None: ...

class WorkerDone(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
