"""Checkpoints are per layer: one cut saves, another loads and trains on exactly as the first would;
broken or hostile files give CheckpointError; a crash mid-save leaves the last commit loadable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint import apply_state, load_layers, stage_state, write_part
from hetlaunch.runtime.checkpoint_manifest import (CHECKPOINT_FORMAT, MANIFEST_NAME, CheckpointError, Manifest,
                                                   PartInfo, checkpoint_dir, latest_checkpoint, prune_checkpoints,
                                                   read_manifest, write_manifest)
from hetlaunch.runtime.model import build_model_range, lm_loss
from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec
from hetlaunch.runtime.stage_command import checkpoint_due

torch.set_num_threads(1)

SPEC = ModelSpec(gpt=GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=2))
N = SPEC.gpt.num_stage_layers  # 4: embedding, 2 blocks, head


class Stage:
    def __init__(self, start: int, end: int, seed: int):
        self.start, self.end = start, end
        self.module = nn.Sequential(*build_model_range(SPEC, start, end, seed).layers)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-2)


def make_cut(bounds: list[int], seed: int) -> list[Stage]:
    return [Stage(a, b, seed) for a, b in zip(bounds, bounds[1:])]


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + i)
    tokens = torch.randint(0, 256, (4, SPEC.gpt.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(cut: list[Stage], i: int) -> float:
    x, y = batch(i)
    for stage in cut:
        x = stage.module(x)
    loss = lm_loss(x, y)
    loss.backward()
    for stage in cut:
        stage.optimizer.step()
        stage.optimizer.zero_grad()
    return loss.item()


def save(cut: list[Stage], root: Path, step: int) -> Path:
    directory = checkpoint_dir(root, step)
    parts = [write_part(directory, stage_state(s.module, s.optimizer, s.start), s.start, s.end) for s in cut]
    write_manifest(directory, step, N, parts, {"model": SPEC.describe()})
    return directory


def load(cut: list[Stage], directory: Path) -> None:
    manifest = read_manifest(directory)
    for s in cut:
        apply_state(s.module, s.optimizer, load_layers(directory, manifest, s.start, s.end), s.start)


def by_global_name(cut: list[Stage]) -> dict[str, tuple[nn.Parameter, dict]]:
    """(parameter, its AdamW state) for every parameter, keyed by global layer index and name."""
    out = {}
    for s in cut:
        for name, p in s.module.named_parameters():
            index, _, rest = name.partition(".")
            out[f"{s.start + int(index)}.{rest}"] = (p, s.optimizer.state.get(p, {}))
    return out


def test_a_checkpoint_of_one_cut_resumes_exactly_on_another(tmp_path):
    cut_a = make_cut([0, 2, N], seed=1)
    for i in range(3):
        train_step(cut_a, i)
    directory = save(cut_a, tmp_path, 3)
    assert sorted(os.listdir(directory)) == ["layers-0-2.safetensors", f"layers-2-{N}.safetensors", MANIFEST_NAME]

    cut_b = make_cut([0, 1, 3, N], seed=2)
    a, b = by_global_name(cut_a), by_global_name(cut_b)
    assert a.keys() == b.keys()
    assert not torch.equal(a["1.fc.weight"][0], b["1.fc.weight"][0])  # the seeds differ: loading must matter
    load(cut_b, directory)
    b = by_global_name(cut_b)
    for name, (pa, sa) in a.items():
        pb, sb = b[name]
        assert torch.equal(pa, pb), name
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for field in sa:
            assert torch.equal(sa[field], sb[field]), (name, field)
        assert sb["step"].dtype == torch.float32 and sb["step"].device.type == "cpu" and sb["step"].dim() == 0
        assert float(sb["step"]) == 3.0

    for i in range(3, 5):
        loss_a, loss_b = train_step(cut_a, i), train_step(cut_b, i)
        assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for name, (pa, _) in a.items():
        assert torch.allclose(pa, b[name][0], atol=1e-6), name


def test_a_checkpoint_before_the_first_step_has_no_optimizer_state(tmp_path):
    cut_a = make_cut([0, 3, N], seed=1)
    state = stage_state(cut_a[0].module, cut_a[0].optimizer, 0)
    assert state and not any(k.startswith("optim.") for k in state)
    assert all(k.startswith(("layers.0.", "layers.1.", "layers.2.")) for k in state)
    directory = save(cut_a, tmp_path, 0)

    cut_b = make_cut([0, 1, N], seed=2)
    load(cut_b, directory)
    for s in cut_b:
        assert not s.optimizer.state
    for name, (pa, _) in by_global_name(cut_a).items():
        assert torch.equal(pa, by_global_name(cut_b)[name][0]), name
    assert train_step(cut_b, 0) == pytest.approx(train_step(cut_a, 0), rel=1e-6)


def test_a_manifest_that_misses_a_layer_is_refused(tmp_path):
    cut = make_cut([0, 2, N], seed=1)
    directory = checkpoint_dir(tmp_path, 1)
    part = write_part(directory, stage_state(cut[0].module, cut[0].optimizer, 0), 0, 2)
    with pytest.raises(CheckpointError, match="no part holds layer 2"):
        write_manifest(directory, 1, N, [part], {})
    with pytest.raises(CheckpointError, match="bytes"):  # a size that is not the file's
        write_manifest(directory, 1, 2, [PartInfo(part.file, 0, 2, part.bytes + 1, part.sha256)], {})
    with pytest.raises(CheckpointError, match="cannot read"):
        write_manifest(directory, 1, 2, [PartInfo("absent.safetensors", 0, 2, 1, part.sha256)], {})
    with pytest.raises(CheckpointError):  # a key outside the part's range
        write_part(directory, stage_state(cut[1].module, None, 2), 0, 2)
    assert not (directory / MANIFEST_NAME).exists()
    assert latest_checkpoint(tmp_path) is None


def test_a_tampered_part_is_named(tmp_path):
    cut = make_cut([0, 2, N], seed=1)
    train_step(cut, 0)
    directory = save(cut, tmp_path, 1)
    manifest = read_manifest(directory)
    path = directory / "layers-2-4.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    load_layers(directory, manifest, 0, 2)  # the untouched part alone still loads
    with pytest.raises(CheckpointError, match="layers-2-4.safetensors.*sha256"):
        load_layers(directory, manifest, 1, 3)
    path.unlink()
    with pytest.raises(CheckpointError, match="layers-2-4.safetensors"):
        load_layers(directory, manifest, 3, 4)


@pytest.mark.parametrize("verify", [True, False], ids=["checked-here", "verified-before"])
def test_a_link_swapped_in_after_the_check_is_not_read(tmp_path, monkeypatch, verify):
    """The part is read through the descriptor that was checked: a name pointed at another file
    between the check and the read (export verifies first, then loads) reads the checked file."""
    import hetlaunch.runtime.checkpoint as checkpoint

    cut = make_cut([0, 2, N], seed=1)
    train_step(cut, 0)
    directory = save(cut, tmp_path, 1)
    expected = load_layers(directory, read_manifest(directory), 0, 2)
    decoy = save(make_cut([0, 2, N], seed=7), tmp_path / "decoy", 1) / "layers-0-2.safetensors"
    part, real_open = directory / "layers-0-2.safetensors", checkpoint.safe_open
    swapped = []

    def swap_then_open(readable, **kwargs):
        part.unlink()
        part.symlink_to(decoy)  # the name now points at a valid part of other weights
        swapped.append(readable)
        return real_open(readable, **kwargs)

    monkeypatch.setattr(checkpoint, "safe_open", swap_then_open)
    state = load_layers(directory, read_manifest(directory), 0, 2, verify=verify)
    assert swapped and all(torch.equal(state[k], expected[k]) for k in expected) and state.keys() == expected.keys()
    monkeypatch.setattr(checkpoint, "safe_open", real_open)
    with pytest.raises(CheckpointError, match="a link, not a file of its own"):
        load_layers(directory, read_manifest(directory), 0, 2, verify=verify)


def test_a_file_renamed_over_a_part_after_its_manifest_was_read_is_not_exported(tmp_path, monkeypatch):
    """Export verified the checkpoint, then read its parts by name again: another part of the same
    size renamed over one in between was exported as if it were the checkpoint's. What export
    reads is hashed as it is read (once: export no longer verifies first), so a part swapped after
    export chose the checkpoint by its manifest is caught there."""
    from hetlaunch.launcher import export as export_module

    cut = make_cut([0, 2, N], seed=1)
    train_step(cut, 0)
    directory = save(cut, tmp_path / "run" / "checkpoints", 1)
    other = make_cut([0, 2, N], seed=7)
    train_step(other, 0)
    decoy = save(other, tmp_path / "decoy", 1) / "layers-0-2.safetensors"
    part = directory / "layers-0-2.safetensors"
    assert decoy.stat().st_size == part.stat().st_size  # only its bytes differ
    read = export_module.checkpoint_manifest

    def read_then_swap(step, found):
        manifest = read(step, found)
        os.replace(decoy, part)
        return manifest

    monkeypatch.setattr(export_module, "checkpoint_manifest", read_then_swap)
    with pytest.raises(export_module.ExportError, match="layers-0-2.safetensors: sha256 does not match"):
        export_module.export(tmp_path / "run", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_part_is_not_read_by_name_where_no_descriptor_path_exists(tmp_path, monkeypatch):
    """Without /proc/self/fd or /dev/fd the name could be another file by now: refused, not read."""
    from hetlaunch.runtime import checkpoint_manifest

    directory = save(make_cut([0, 2, N], seed=1), tmp_path, 1)
    real_exists = os.path.exists
    monkeypatch.setattr(checkpoint_manifest.os.path, "exists",
                        lambda p: False if str(p).startswith(("/proc/self/fd/", "/dev/fd/")) else real_exists(p))
    with pytest.raises(CheckpointError, match="through the descriptor that was checked"):
        load_layers(directory, read_manifest(directory), 0, 2)


def test_a_manifest_that_is_a_link_is_refused(tmp_path):
    directory = save(make_cut([0, 2, N], seed=1), tmp_path, 1)
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(directory / MANIFEST_NAME, elsewhere)
    (directory / MANIFEST_NAME).symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="a link, not a file of its own"):
        read_manifest(directory)
    assert latest_checkpoint(tmp_path) is None


def test_a_part_whose_keys_do_not_fit_the_stage_is_refused(tmp_path):
    cut = make_cut([0, 2, N], seed=1)
    directory = save(cut, tmp_path, 0)
    state = load_layers(directory, read_manifest(directory), 0, 2)
    other = make_cut([0, 1, N], seed=1)[0]
    with pytest.raises(CheckpointError, match=r"unexpected 1\.\w+"):
        apply_state(other.module, other.optimizer, state, 0)
    fresh = make_cut([0, 2, N], seed=9)[0]
    before = {k: v.clone() for k, v in fresh.module.state_dict().items()}
    del state["layers.1.fc.bias"]
    with pytest.raises(CheckpointError, match=r"missing 1\.fc\.bias"):
        apply_state(fresh.module, fresh.optimizer, state, 0)
    state["layers.1.fc.bias"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"shape of 1\.fc\.bias"):
        apply_state(fresh.module, fresh.optimizer, state, 0)
    state["optim.0.tok.weight.exp_avg"] = torch.zeros(1)
    with pytest.raises(CheckpointError):
        apply_state(fresh.module, fresh.optimizer, state, 0)
    for k, v in fresh.module.state_dict().items():  # a refused checkpoint changes nothing
        assert torch.equal(v, before[k]), k
    assert not fresh.optimizer.state


GOOD = {"format": CHECKPOINT_FORMAT, "step": 2, "num_layers": 2, "extra": {},
        "parts": [{"file": "layers-0-2.safetensors", "layer_start": 0, "layer_end": 2, "bytes": 10,
                   "sha256": "0" * 64}]}


def _with(**changes) -> str:
    d = json.loads(json.dumps(GOOD))
    part = changes.pop("part", {})
    d["parts"][0].update(part)
    d.update(changes)
    return json.dumps(d)


HOSTILE = {
    "traversal": _with(part={"file": "../x"}),
    "absolute": _with(part={"file": "/etc/passwd"}),
    "hidden": _with(part={"file": ".layers.tmp"}),
    "negative step": _with(step=-1),
    "bool step": _with(step=True),
    "float step": _with(step=2.0),
    "nan": _with().replace('"step": 2', '"step": NaN'),
    "huge number": _with().replace('"step": 2', '"step": ' + "9" * 5000),
    "wrong format": _with(format="hetlaunch-checkpoint/999"),
    "no format": json.dumps({k: v for k, v in GOOD.items() if k != "format"}),
    "extra key": _with(surprise=1),
    "not an object": "[1, 2]",
    "not json": "{",
    "not utf-8": b"\xff\xfe{}",
    "empty range": _with(part={"layer_start": 1, "layer_end": 1}),
    "past the end": _with(part={"layer_end": 3}),
    "gap": _with(num_layers=10 ** 30),
    "bad sha": _with(part={"sha256": "xyz"}),
    "no parts": _with(parts=[]),
    "parts not a list": _with(parts={"a": 1}),
    "part not an object": _with(parts=["layers-0-2.safetensors"]),
    "listed twice": _with(parts=[GOOD["parts"][0], GOOD["parts"][0]]),
    "huge file": '{"pad": "' + "x" * (17 * 1024 * 1024) + '"}',
    "deep": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_manifest_is_a_checkpoint_error(tmp_path, text):
    directory = checkpoint_dir(tmp_path, 2)
    directory.mkdir(parents=True)
    (directory / MANIFEST_NAME).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=MANIFEST_NAME):
        read_manifest(directory)
    assert latest_checkpoint(tmp_path) is None
    prune_checkpoints(tmp_path, keep=1)  # nothing committed: nothing removed
    assert directory.exists()


def test_the_good_manifest_used_above_reads(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(_with())
    assert read_manifest(tmp_path) == Manifest(2, 2, [PartInfo.from_dict(GOOD["parts"][0])], {})
    with pytest.raises(CheckpointError, match="no manifest"):
        read_manifest(tmp_path / "elsewhere")


def test_latest_skips_broken_manifests_and_prune_keeps_the_newest(tmp_path):
    cut = make_cut([0, N], seed=1)
    for step in (1, 3, 5):
        save(cut, tmp_path, step)
    checkpoint_dir(tmp_path, 2).mkdir()  # an interrupted save: parts, no manifest
    broken = checkpoint_dir(tmp_path, 7)
    broken.mkdir()
    (broken / MANIFEST_NAME).write_text("{")
    (tmp_path / "step-000000009").mkdir()  # not the canonical name of step 9
    directory, manifest = latest_checkpoint(tmp_path)
    assert directory == checkpoint_dir(tmp_path, 5) and manifest.step == 5 and manifest.num_layers == N

    prune_checkpoints(tmp_path, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-000000009", "step-00000003", "step-00000005", "step-00000007"]
    prune_checkpoints(tmp_path, keep=1)
    assert latest_checkpoint(tmp_path)[1].step == 5
    assert not checkpoint_dir(tmp_path, 3).exists() and broken.exists()  # newer than the last commit: kept
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, keep=0)


_WRITER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from hetlaunch.runtime.checkpoint import write_part
    state = {"layers.0.big": torch.ones(50 * 1024 * 1024)}  # 200 MB
    while True:  # killed from outside, mid-write
        write_part(Path(sys.argv[1]), state, 0, 1)
""")


def _kill_mid_write(directory: Path) -> bool:
    """Start a writer and SIGKILL it while a part is half written; True if a temp file stayed behind."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory)])
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and proc.poll() is None:
            if directory.exists() and any(n.endswith(".tmp") for n in os.listdir(directory)):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    return any(n.endswith(".tmp") for n in os.listdir(directory)) if directory.exists() else False


@pytest.mark.timeout(60)
def test_a_crash_mid_write_leaves_the_last_checkpoint(tmp_path):
    cut = make_cut([0, N], seed=1)
    train_step(cut, 0)
    train_step(cut, 1)
    save(cut, tmp_path, 2)
    leftover = checkpoint_dir(tmp_path, 4)
    assert any(_kill_mid_write(leftover) for _ in range(3)), "the writer was never caught mid-write"
    assert not (leftover / MANIFEST_NAME).exists()

    directory, manifest = latest_checkpoint(tmp_path)
    assert manifest.step == 2
    load(make_cut([0, 2, N], seed=5), directory)
    prune_checkpoints(tmp_path, keep=2)
    assert leftover.exists()  # newer than the last commit: it may be a save in progress

    save(cut, tmp_path, 6)  # the resumed run commits a newer checkpoint: now the leftover is garbage
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000006"]


@pytest.mark.parametrize("every,steps,due", [(5, 12, [5, 10, 12]), (50, 12, [12]), (4, 12, [4, 8, 12]), (0, 12, [])])
def test_a_stage_checkpoints_every_k_steps_and_after_the_last_and_never_at_0(every, steps, due):
    train = pb.TrainSpec(steps=steps, checkpoint_every=every, checkpoint_dir="/somewhere")
    assert [done for done in range(1, steps + 1) if checkpoint_due(train, done)] == due
