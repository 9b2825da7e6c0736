"""export, report, status and logs on a finished run's directory made hostile: each case is one a
hostile review found failing (a spin for hours, gigabytes allocated for a lie, a checkpoint
skipped without a word or overwritten by its own export, a file written through a planted link,
tracebacks) and each failed before its fix. One real run (tests/conftest.py `finished`) copied
for each case."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import run_hetlaunch
from finished_run import checkpoint_step, one_error_line
from hetlaunch.launcher.run_control import RunControlError, contact_of


def _edit_manifest(step_dir, edit) -> None:
    path = step_dir / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.timeout(120)
def test_export_of_a_manifest_claiming_a_trillion_layers_is_one_line_at_once(run_copy, tmp_path):
    """load_layers walked every layer of num_layers: 10**12 spun export for hours."""
    def lie(data):
        data["num_layers"] = 10**12
        data["parts"][-1]["layer_end"] = 10**12
    _edit_manifest(checkpoint_step(run_copy, 4), lie)
    result = run_hetlaunch("export", str(checkpoint_step(run_copy, 4)), "-o", str(tmp_path / "m.safetensors"),
                           timeout=60)
    one_error_line(result, 2)
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.timeout(120)
def test_export_checks_a_gigantic_model_a_manifest_names_without_allocating_it(run_copy, tmp_path):
    """The GPT's layers were given storage even when asked for their shapes: a vocabulary of 10**9
    (128 GB of embedding at this width) would be allocated before the shapes were compared."""
    _edit_manifest(checkpoint_step(run_copy, 4), lambda data: data["extra"]["model_spec"]["gpt"].update(vocabSize=10**9))
    result = run_hetlaunch("export", str(run_copy), "-o", str(tmp_path / "m.safetensors"), timeout=60)
    assert "does not fit its model" in one_error_line(result, 2)


@pytest.mark.timeout(120)
def test_export_says_which_newer_checkpoint_it_skipped_as_not_intact(run_copy, tmp_path):
    """A corrupt newest manifest made export take the one before without a word."""
    (checkpoint_step(run_copy, 4) / "manifest.json").write_text("garbage")
    result = run_hetlaunch("export", str(run_copy), "-o", str(tmp_path / "m.safetensors"), timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("skipped the checkpoint of step 4, not intact: ") and "at step 2" in lines[1], lines


@pytest.mark.timeout(120)
def test_export_skips_a_newer_checkpoint_whose_part_was_changed_and_says_so(run_copy, tmp_path):
    """Each part is hashed as export reads it (not verified first, then read and hashed again):
    a changed part still sends it to the checkpoint before."""
    step = checkpoint_step(run_copy, 4)
    part = next(p for p in step.iterdir() if p.suffix == ".safetensors")
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF  # the same size: only the hash tells
    part.write_bytes(bytes(data))
    result = run_hetlaunch("export", str(run_copy), "-o", str(tmp_path / "m.safetensors"), timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("skipped the checkpoint of step 4, not intact: ") and "sha256" in lines[0], lines
    assert "at step 2" in lines[1], lines


@pytest.mark.timeout(120)
def test_export_reads_each_part_once(run_copy, tmp_path):
    """It read every part twice (verified, then hashed again as it loaded): twice the reading of
    a checkpoint of hundreds of GB. Counted by the kernel (/proc/self/io rchar: the bytes this
    process read), around a second export, the first having imported what export imports."""
    from hetlaunch.launcher.export import export

    def bytes_read() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

    export(run_copy, tmp_path / "first" / "m.safetensors")
    before = bytes_read()
    export(run_copy, tmp_path / "second" / "m.safetensors")
    read = bytes_read() - before
    parts = sum(p.stat().st_size for p in checkpoint_step(run_copy, 4).glob("*.safetensors"))
    assert parts <= read < 1.5 * parts, (read, parts)


@pytest.mark.timeout(120)
def test_export_never_writes_into_the_checkpoint_it_reads(run_copy, tmp_path):
    """-o naming a part of the checkpoint replaced it with the merged file: the checkpoint broke."""
    step = checkpoint_step(run_copy, 4)
    part = next(step.glob("layers-*.safetensors"))
    before = part.read_bytes()
    result = run_hetlaunch("export", str(run_copy), "-o", str(part), timeout=60)
    assert "inside the checkpoint it exports" in one_error_line(result, 2)
    assert part.read_bytes() == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("read", ["run", "a_link_to_its_step", "a_step_its_root_holds_as_a_link"])
@pytest.mark.parametrize("where", ["checkpoints/model.safetensors", "checkpoints/new/model.safetensors"])
def test_export_never_writes_into_the_checkpoint_root_it_reads_from(run_copy, tmp_path, where, read):
    """-o RUN/checkpoints put the merged file among the run's step folders; a link to a step folder
    (named by a review) took the link's own folder for its root."""
    before = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    source = run_copy
    if read == "a_link_to_its_step":
        source = tmp_path / "steplink"
        source.symlink_to(checkpoint_step(run_copy, 4))
    if read == "a_step_its_root_holds_as_a_link":  # the step folder elsewhere, a link to it in the root
        step = checkpoint_step(run_copy, 4)
        shutil.move(step, tmp_path / step.name)
        step.symlink_to(tmp_path / step.name)
        source = step
    result = run_hetlaunch("export", str(source), "-o", str(run_copy / where), timeout=60)
    assert "inside the checkpoint root of the checkpoint it exports" in one_error_line(result, 2)
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == before


@pytest.mark.timeout(120)
def test_export_writes_beside_a_step_folder_copied_out_of_its_run(run_copy, tmp_path):
    """A checkpoint root is where `up` kept a run's checkpoints (its lock file there): a step
    folder copied into a home made every -o under that home "inside the checkpoint root" (a review)."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copytree(checkpoint_step(run_copy, 4), home / "step-00000004")
    result = run_hetlaunch("export", str(home / "step-00000004"), "-o", str(home / "models" / "m.safetensors"),
                           timeout=60)
    assert result.returncode == 0, result.stderr
    assert (home / "models" / "m.safetensors").is_file()


@pytest.mark.timeout(120)
def test_report_writes_through_no_link_planted_where_it_writes(run_copy, tmp_path):
    """report wrote training.png.tmp, a fixed name: a link planted there took its PNG into the
    file it pointed at. A link at a PNG's own place is replaced, never written through."""
    pytest.importorskip("matplotlib")  # the dev extra installs it; `report` needs the plots extra
    out = tmp_path / "report"
    out.mkdir()
    victims = [tmp_path / "victim-tmp.txt", tmp_path / "victim-png.txt"]
    for victim in victims:
        victim.write_text("mine\n")
    (out / "training.png.tmp").symlink_to(victims[0])
    (out / "plan.png").symlink_to(victims[1])
    result = run_hetlaunch("report", str(run_copy), "-o", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    assert [v.read_text() for v in victims] == ["mine\n", "mine\n"]
    assert not (out / "plan.png").is_symlink() and (out / "plan.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spoil", ["step", "layer_end", "shares", "pipeline"])
def test_report_on_records_no_run_writes_is_one_line(run_copy, spoil):
    pytest.importorskip("matplotlib")
    summary = run_copy / "summary.json"
    data = json.loads(summary.read_text())
    stage = data["plan"]["stages"][0]
    if spoil == "step":  # OverflowError
        metrics = run_copy / "metrics.jsonl"
        metrics.write_text(metrics.read_text().replace('"step": 0,', '"step": 1e400,', 1))
    elif spoil == "layer_end":
        stage["layer_end"] = 10**400
    elif spoil == "shares":  # ZeroDivisionError
        data["plan"]["pipeline_microbatches"] = [0]
    else:  # IndexError
        stage["pipeline"] = 7
    summary.write_text(json.dumps(data))
    result = run_hetlaunch("report", str(run_copy), timeout=120)
    assert "not ones hetlaunch wrote" in one_error_line(result, 2) or "not a hetlaunch metrics file" in result.stderr


@pytest.mark.parametrize("contact, reason", [({"address": "127.0.0.1:1", "pid": 1e400}, "OverflowError"),
                                             ({"address": "127.0.0.1:1", "pid": 1, "tls": {"x": 1}}, "tls entry"),
                                             ({"address": "127.0.0.1:1", "pid": 1, "tls": {"ca": 5}}, "tls entry")])
def test_a_coordinator_json_that_no_run_writes_is_one_line(tmp_path, contact, reason):
    (tmp_path / "coordinator.json").write_text(json.dumps(contact).replace("Infinity", "1e400"))
    with pytest.raises(RunControlError, match=reason):
        contact_of(tmp_path)


@pytest.mark.timeout(60)
def test_logs_reads_only_the_logs_up_wrote(run_copy, tmp_path):
    """`logs RUN ../../outside` read a file outside the run; a log linked to another file printed it."""
    (tmp_path / "outside.log").write_text("not a log of the run\n")
    result = run_hetlaunch("logs", str(run_copy), "../../outside", timeout=30)
    assert "is not a node name" in one_error_line(result, 2) and "not a log" not in result.stdout
    secret = tmp_path / "secret.txt"
    secret.write_text("the reader's own file\n")
    (run_copy / "logs" / "a.log").unlink()
    (run_copy / "logs" / "a.log").symlink_to(secret)
    result = run_hetlaunch("logs", str(run_copy), "a", timeout=30)
    assert "a link, not a log" in one_error_line(result, 2) and "the reader's own file" not in result.stdout
    assert os.path.exists(secret)


@pytest.mark.timeout(120)
def test_export_into_a_directory_whose_weights_file_is_a_folder_names_that_folder(run_copy, tmp_path):
    """The rename over it failed naming the export's temp file (`.model.safetensors.0fa00554.tmp: Is a
    directory`; a hostile review): said of the folder in the way, before any work, nothing left behind."""
    out = tmp_path / "out"
    (out / "model.safetensors").mkdir(parents=True)
    result = run_hetlaunch("export", str(run_copy), "-o", str(out), timeout=60)
    assert one_error_line(result, 2) == f"error: {out}/model.safetensors: a folder is in its place; move it, or export elsewhere"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
