"""A finished run's directory made hostile, or used again: what export, --resume, status and a
second `up` do with it. Each case is one a hostile review found failing (a command run from a
manifest, a hang on a FIFO, a traceback, a run's checkpoints written over); each failed before
its fix.

One real run (a 1-node tiny model, 4 steps, checkpoints at 2 and 4) is made once and copied for
each case.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import run_hetlaunch
from finished_run import CLUSTER, checkpoint_step, one_error_line
from hetlaunch.launcher.run_control import RunControlError, contact_of, last_record
from small_disk import fill, small_tmpfs


@pytest.fixture
def run(run_copy):
    """A copy of the finished run (tests/conftest.py), for one case to spoil."""
    return run_copy


@pytest.mark.timeout(120)
def test_export_imports_no_entrypoint_a_checkpoint_names_unless_allowed(run, tmp_path):
    """A manifest naming os:system ran `touch` through export."""
    manifest = checkpoint_step(run, 4) / "manifest.json"
    data = json.loads(manifest.read_text())
    sentinel = tmp_path / "PWNED"
    data["extra"]["model_spec"] = {"entrypoint": {"entrypoint": "os:system", "kwargs": {"command": f"touch {sentinel}"}}}
    manifest.write_text(json.dumps(data))
    result = run_hetlaunch("export", str(run), "-o", str(tmp_path / "m.safetensors"), timeout=60)
    assert "names model entrypoint 'os:system', which export imports only when --allow-entrypoint matches it" in \
        one_error_line(result, 2)
    assert not sentinel.exists() and not (tmp_path / "m.safetensors").exists()


@pytest.mark.timeout(150)
def test_a_fifo_in_a_checkpoint_parts_place_is_refused_not_waited_on(run, tmp_path):
    """With the manifest saying 0 bytes, a FIFO held export and resume forever."""
    step = checkpoint_step(run, 4)
    manifest = json.loads((step / "manifest.json").read_text())
    part = manifest["parts"][0]
    (step / part["file"]).unlink()
    os.mkfifo(step / part["file"])
    part["bytes"], part["sha256"] = 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # of b""
    (step / "manifest.json").write_text(json.dumps(manifest))
    result = run_hetlaunch("export", str(step), "-o", str(tmp_path / "m.safetensors"), timeout=60)
    assert f"{step / part['file']}: not a regular file" in one_error_line(result, 2)
    resumed = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run), timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at step 2" in resumed.stdout  # step 4 set aside, the one before taken


@pytest.mark.timeout(150)
def test_resuming_a_run_at_its_last_step_says_there_is_nothing_left(run, tmp_path):
    """It ended in a traceback (no generation had run, so no plan was current); then it started
    every agent, profiled and rewrote summary.json with a wall time of 0, no checkpoints and no
    events (a hostile review). Now nothing starts and nothing of the run is written."""
    def records():  # every file but the locks, which hold the pid of whoever took them last
        return {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "up.lock"}
    before = records()
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "the checkpoint at step 4 is this run's last (train.steps: 4): nothing left to train" in result.stdout
    assert "coordinator listening" not in result.stdout and "plan" not in result.stdout.lower(), result.stdout
    assert records() == before
    # A run killed after its last checkpoint, before its summary (or with the summary of an earlier
    # `down`, of fewer steps): the resume writes the summary.
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "steps": 2}))
    stale = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run), timeout=120)
    assert stale.returncode == 0 and json.loads((run / "summary.json").read_text())["steps"] == 4, stale.stderr
    (run / "summary.json").unlink()
    again = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run), timeout=120)
    assert again.returncode == 0, again.stderr
    assert "nothing left to train" in again.stdout and json.loads((run / "summary.json").read_text())["steps"] == 4


@pytest.mark.timeout(120)
def test_up_never_starts_a_new_run_over_an_old_ones_records_or_checkpoints(run, tmp_path):
    """`up --run-dir` on a finished run emptied its metrics.jsonl and wrote over its checkpoints;
    a run sharing another's checkpoint.dir pruned its own newest checkpoint for the other's."""
    metrics = (run / "metrics.jsonl").read_text()
    again = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run), timeout=60)
    assert f"{run} holds a run already (its metrics.jsonl): continue it with `--resume {run}`" in one_error_line(again, 1)
    assert (run / "metrics.jsonl").read_text() == metrics
    shared = tmp_path / "shared.yaml"
    shared.write_text(CLUSTER.format(steps=4) + f"checkpoint: {{dir: {run / 'checkpoints'}}}\n")
    other = run_hetlaunch("up", str(shared), "--run-dir", str(tmp_path / "other"), timeout=60)
    assert f"{run / 'checkpoints'} holds another run's checkpoint (step 4)" in one_error_line(other, 1)
    assert not (tmp_path / "other").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", ['{"step": 1e999, "loss": 1, "tokens_per_s": 1, "step_s": 1, "stages": []}',
                                 '[' * 100_000 + ']' * 100_000,
                                 '{"step": 0, "loss": 1, "tokens_per_s": 1, "step_s": 1, "stages": [1, 2]}'])
def test_a_metrics_line_that_is_not_ours_stops_a_resume_naming_it(run, tmp_path, bad):
    """Tracebacks before (an infinite step, a line nested 100,000 deep), or a crash after training
    with no summary.json (stages that are not stage rows)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], bad, *lines[1:]]) + "\n")
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run), timeout=60)
    assert "line 2 is not a step record" in one_error_line(result, 1)


@pytest.mark.timeout(150)
def test_a_fifo_for_events_jsonl_does_not_hold_a_resume(run, tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER.format(steps=6))
    (run / "events.jsonl").unlink()
    os.mkfifo(run / "events.jsonl")
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run), timeout=120)
    assert result.returncode == 0 and "resuming at step 4" in result.stdout, result.stderr


@pytest.mark.timeout(60)
def test_status_reads_a_hostile_coordinator_json_in_one_line(tmp_path):
    """A FIFO hung status; nesting, a huge pid and /dev/zero ended in tracebacks."""
    path = tmp_path / "coordinator.json"
    assert "not a run directory (no coordinator.json)" in one_error_line(run_hetlaunch("status", str(tmp_path),
                                                                                     timeout=30), 2)
    cases = {"fifo": "not a regular file", "deep": "nested too deeply",
             "pid": "is not a process id", "zero": "not a regular file"}
    for case, reason in cases.items():
        path.unlink(missing_ok=True)
        if case == "fifo":
            os.mkfifo(path)
        elif case == "deep":  # under the size bound
            path.write_text("[" * 20_000 + "]" * 20_000)
        elif case == "pid":
            path.write_text(json.dumps({"address": "127.0.0.1:1", "pid": 10**30}))
        else:
            path.symlink_to("/dev/zero")
        with pytest.raises(RunControlError, match=reason):
            contact_of(tmp_path)
        result = run_hetlaunch("status", str(tmp_path), timeout=30)
        assert reason in one_error_line(result, 2)  # bad input, as `logs -f` says it (it said 1)
        assert reason in one_error_line(run_hetlaunch("down", str(tmp_path), timeout=30), 2)
    (tmp_path / "metrics.jsonl").unlink(missing_ok=True)
    os.mkfifo(tmp_path / "metrics.jsonl")
    assert last_record(tmp_path) is None  # not waited on


@pytest.mark.timeout(120)
def test_export_to_a_full_disk_is_one_line_and_leaves_nothing(run, tmp_path):
    """safetensors' own error came out as a traceback; into a new directory, the directories it
    made were left behind, empty."""
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        fill(disk, 4096)
        result = run_hetlaunch("export", str(run), "-o", str(disk / "m.safetensors"), timeout=60)
        line = one_error_line(result, 2)
        assert "m.safetensors" in line and ("No space left" in line or "cannot write" in line), line
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
        (disk / "kept").mkdir()  # a directory that was there stays
        for output in (disk / "new" / "deeper" / "model", disk / "kept" / "new" / "m.safetensors"):
            line = one_error_line(run_hetlaunch("export", str(run), "-o", str(output), timeout=60), 2)
            assert "No space left" in line or "cannot write" in line, line
            assert sorted(p.name for p in disk.iterdir()) == ["filler", "kept"]
            assert list((disk / "kept").iterdir()) == []


@pytest.mark.timeout(120)
def test_a_checkpoint_part_linked_to_a_file_elsewhere_is_refused_even_when_its_sha256_matches(run, tmp_path):
    """Export and resume read a part through a link to any file of the reader's where the manifest
    stated that file's size and sha256."""
    step = checkpoint_step(run, 4)
    part = json.loads((step / "manifest.json").read_text())["parts"][0]["file"]
    elsewhere = tmp_path / "elsewhere.safetensors"
    os.replace(step / part, elsewhere)
    (step / part).symlink_to(elsewhere)  # the same bytes: its size and sha256 are the manifest's
    result = run_hetlaunch("export", str(step), "-o", str(tmp_path / "m.safetensors"), timeout=60)
    assert f"{step / part}: a link, not a file of its own (not followed)" in one_error_line(result, 2)
    assert not (tmp_path / "m.safetensors").exists()
    result = run_hetlaunch("export", str(run), "-o", str(tmp_path / "m.safetensors"), timeout=60)
    assert result.returncode == 0 and "skipped the checkpoint of step 4" in result.stdout + result.stderr, result.stderr


def test_a_checkpoint_of_the_wrong_dtypes_is_refused_not_converted():
    """load_state_dict converted bool or int64 weights silently, and the run went on from them."""
    from hetlaunch.runtime.checkpoint import apply_state
    from hetlaunch.runtime.checkpoint_manifest import CheckpointError

    module = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    state = {f"layers.0.{k}": v.clone() for k, v in module[0].state_dict().items()}
    state["layers.0.weight"] = state["layers.0.weight"].to(torch.int64)
    with pytest.raises(CheckpointError, match=r"dtype of 0.weight: torch.int64 != torch.float32"):
        apply_state(module, None, state, 0)


@pytest.mark.timeout(150)
def test_a_resume_removes_the_replica_snapshots_a_killed_up_left(run, tmp_path):
    """`up` SIGKILLed during a recovery left replica-g<k>/<node>/ (a copy of the model per node),
    kept through every later resume."""
    (tmp_path / "cluster.yaml").write_text(CLUSTER.format(steps=6))
    stale = run / "checkpoints" / "replica-g2" / "a"
    stale.mkdir(parents=True)
    (stale / "layers-0-4.safetensors").write_bytes(b"\0" * 1024)
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run), timeout=120)
    assert result.returncode == 0, result.stderr
    assert not (run / "checkpoints" / "replica-g2").exists()
    assert (checkpoint_step(run, 6) / "manifest.json").is_file()  # and the run went on to its end


def test_a_checkpoint_stripped_of_its_optimizer_state_is_refused_not_resumed_with_fresh_moments():
    """AdamW (and SGD with momentum) resumed from weights alone restarted their moments: silently a
    different run. A live move of untrained layers (step 0) and SGD without momentum hold none."""
    from hetlaunch.runtime.checkpoint import apply_state, stage_state
    from hetlaunch.runtime.checkpoint_manifest import CheckpointError

    def trained(optimizer_of):
        module = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
        optimizer = optimizer_of(module.parameters())
        module[0](torch.ones(1, 2)).sum().backward()
        optimizer.step()
        return module, optimizer

    for optimizer_of, keeps in ((lambda p: torch.optim.AdamW(p, lr=0.1), True),
                                (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), True),
                                (lambda p: torch.optim.SGD(p, lr=0.1), False)):
        module, optimizer = trained(optimizer_of)
        weights = {k: v for k, v in stage_state(module, optimizer, 0).items() if k.startswith("layers.")}
        fresh = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
        fresh_optimizer = optimizer_of(fresh.parameters())
        apply_state(fresh, fresh_optimizer, weights, 0)  # a move before any step: nothing to miss
        if keeps:
            with pytest.raises(CheckpointError, match=r"no optimizer state, though this run's \w+ keeps some and "
                                                      r"the checkpoint is of step 3"):
                apply_state(fresh, fresh_optimizer, weights, 0, resumed_step=3)
        else:
            apply_state(fresh, fresh_optimizer, weights, 0, resumed_step=3)
        apply_state(fresh, fresh_optimizer, stage_state(module, optimizer, 0), 0, resumed_step=3)  # whole: fine


@pytest.mark.parametrize("spoil, message", [
    (lambda s: s.update({"optim.0.weight.step": torch.zeros(1000)}),
     r"optimizer step of 0\.weight: not one whole, non-negative count \(1000 value"),
    (lambda s: s.update({"optim.0.weight.step": torch.tensor(float("nan"))}), r"optimizer step of 0\.weight: not one"),
    (lambda s: s.update({"optim.0.weight.step": torch.tensor(-1.0)}), r"optimizer step of 0\.weight: not one"),
    (lambda s: s.update({"optim.0.weight.step": torch.tensor(2.5)}), r"optimizer step of 0\.weight: not one"),
    (lambda s: s.update({"optim.0.bias.exp_avg": s["optim.0.bias.exp_avg"].to(torch.bfloat16)}),
     r"dtype of optimizer state of 0\.bias: not torch\.float32"),
])
def test_optimizer_state_that_no_run_writes_is_refused_naming_it(spoil, message):
    """A hostile review's edited checkpoints: a step of 1,000 values failed on the worker naming no
    file, a NaN step ran the loss to nan (exit 0), bf16 moments were cast silently."""
    from hetlaunch.runtime.checkpoint import apply_state, stage_state
    from hetlaunch.runtime.checkpoint_manifest import CheckpointError

    module = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module[0](torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state = stage_state(module, optimizer, 0)
    spoil(state)
    fresh = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(CheckpointError, match=message):
        apply_state(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1), state, 0, resumed_step=1)


def test_an_fp16_resume_expects_no_optimizer_state():
    """fp16 skips the steps whose gradients overflowed, the first ones above all: a checkpoint of
    them rightly holds no optimizer state, and refusing it would refuse a run's own checkpoint."""
    from hetlaunch.protos import control_pb2 as pb
    from hetlaunch.runtime.checkpoint import resumed_step_of

    assert resumed_step_of(pb.TrainSpec(start_step=4, precision="fp16")) == 0
    assert resumed_step_of(pb.TrainSpec(start_step=4, precision="bf16")) == 4
    assert resumed_step_of(pb.TrainSpec(start_step=4)) == 4


def _craft(step, edit) -> None:
    """Rewrite each part of a committed checkpoint through edit(tensors) -> tensors, keeping its
    metadata and making the manifest's sizes and digests agree: a crafted checkpoint, not a damaged one."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    manifest = json.loads((step / "manifest.json").read_text())
    for part in manifest["parts"]:
        path = step / part["file"]
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
        save_file(edit(load_file(path)), path, metadata=metadata)
        part["bytes"], part["sha256"] = path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.timeout(150)
def test_resume_from_a_checkpoint_without_optimizer_state_fails_in_one_line(run, tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER.format(steps=6))
    _craft(checkpoint_step(run, 4), lambda tensors: {k: v for k, v in tensors.items() if k.startswith("layers.")})
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("no optimizer state, though this run's AdamW keeps some and the checkpoint is of step 4"
            in result.stdout + result.stderr)
    assert not checkpoint_step(run, 6).exists()  # nothing trained from the fresh moments


@pytest.mark.timeout(120)
@pytest.mark.parametrize("edit, problem", [
    (lambda t: {**t, "layers.1.ln1.weight": torch.ones(7)}, "layers.1.ln1.weight has shape [7], the model's is [32]"),
    (lambda t: {k: v for k, v in t.items() if k != "layers.1.ln1.weight"}, "layers.1.ln1.weight missing"),
    (lambda t: {**t, "layers.1.extra": torch.ones(2)}, "layers.1.extra is not the model's"),
])
def test_export_refuses_weights_that_do_not_fit_the_model(run, tmp_path, edit, problem):
    """A checkpoint whose tensors do not fit the model it names exported a file that loaded wrong."""
    step = checkpoint_step(run, 4)
    _craft(step, edit)
    result = run_hetlaunch("export", str(step), "-o", str(tmp_path / "m.safetensors"), timeout=60)
    assert f"{step}: the checkpoint does not fit its model: {problem}" in one_error_line(result, 2)
    assert not (tmp_path / "m.safetensors").exists()


VALUE_READING_MODEL = '''
import torch
from torch import nn
from hetlaunch.runtime.gpt import lm_loss
from hetlaunch.runtime.model import LayeredModel

class ValueReading(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.register_buffer("scale", torch.tensor(float(torch.ones(1).item() * 2)))  # .item(): no meta

    def forward(self, x):
        return x @ self.w * self.scale

def build(seq_len=8):
    layers = {0: lambda: nn.Embedding(32, 16), 2: lambda: nn.Linear(16, 32)}
    return LayeredModel(3, lambda i: layers.get(i, ValueReading)(), lm_loss, vocab_size=32)
'''


def test_export_checks_a_model_that_cannot_be_built_on_meta_by_building_it(tmp_path, monkeypatch):
    """Its layers read values while they are built: export refused a checkpoint that trained fine."""
    from google.protobuf import json_format

    from hetlaunch.launcher.export import export
    from hetlaunch.runtime.checkpoint import stage_state, write_part
    from hetlaunch.runtime.checkpoint_manifest import checkpoint_dir, write_manifest
    from hetlaunch.runtime.model import build_layer, describe_model
    from hetlaunch.runtime.model_spec import ModelSpec
    from hetlaunch.runtime.wire import model_spec_to_proto

    (tmp_path / "value_reading.py").write_text(VALUE_READING_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelSpec(entrypoint="value_reading:build", kwargs={"seq_len": 8})
    model = describe_model(spec, seed=0)
    module = torch.nn.ModuleList(build_layer(model, i, 0) for i in range(model.num_layers))
    step = checkpoint_dir(tmp_path / "checkpoints", 3)
    part = write_part(step, stage_state(module, None, 0), 0, model.num_layers)
    write_manifest(step, 3, model.num_layers, [part], {"model": spec.describe(),
                                                        "model_spec": json_format.MessageToDict(model_spec_to_proto(spec))})
    done = export(tmp_path, tmp_path / "m.safetensors", allow_entrypoints=("value_reading:*",))
    assert done.step == 3 and done.tensors == 5  # the embedding; w and scale; the linear weight and bias


def test_logs_prints_a_log_a_piece_at_a_time_with_its_escape_sequences_shown(tmp_path):
    """`logs` read a log whole (a 3 GB log: MemoryError) and wrote a worker's escape sequences raw."""
    import io

    from hetlaunch.launcher import run_control

    log = tmp_path / "a.log"
    head = b"x" * (run_control.LOG_READ_BYTES - 1)
    log.write_bytes(head + "é".encode() + b" \x1b]0;owned\x07 done\n")  # é split across two reads
    out = io.StringIO()
    run_control.follow_log(log, None, out)
    assert out.getvalue() == head.decode() + "é \\x1b]0;owned\\x07 done\n"
