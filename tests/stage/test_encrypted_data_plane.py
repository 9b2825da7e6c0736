"""data_plane.encrypt end to end: `hetlaunch up` with real agents, gloo and sealed messages.
Encryption is lossless, so a sealed run equals the clear run bit for bit — one pipeline across
two regions (its link sealed), with exact and with int8 activations, two pipelines under `all`
(links and the gradient sync among holders sealed), and islands whose outer exchange is sealed."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from conftest import final_parameters, run_hetlaunch
from user_model import PLANTED, PLANTED_WIDTH
from wire_capture import PacketCapture
from single_process_reference import CFG, DATA_SEED, LR, MICRO_BATCH, NUM_MICRO, SEED, WEIGHT_DECAY

STEPS = 4

HEAD = f"""
name: sealed
model: {{preset: tiny, seq_len: {CFG.seq_len}, d_model: {CFG.d_model}, n_layers: {CFG.n_layers}, n_heads: {CFG.n_heads}}}
data: {{seed: {DATA_SEED}}}
train: {{steps: {STEPS}, micro_batch_size: {MICRO_BATCH}, num_microbatches: {NUM_MICRO}, lr: {LR},
         weight_decay: {WEIGHT_DECAY}, seed: {SEED}, grad_clip: 1.0PIPELINES}}
compression: {{intra_region: CODEC, cross_region: CODEC, sync: none, sync_topology: ring}}
data_plane: {{encrypt: MODE}}
"""

ONE_PIPELINE = """nodes:
  - {name: east0, region: east, device: cpu, threads: 1, layers: [0, 4]}
  - {name: west0, region: west, device: cpu, threads: 1, layers: [4, 8]}
"""

TWO_PIPELINES = """nodes:
  - {name: east0, region: east, device: cpu, threads: 1, pipeline: 0, layers: [0, 3]}
  - {name: west0, region: west, device: cpu, threads: 1, pipeline: 0, layers: [3, 8]}
  - {name: east1, region: east, device: cpu, threads: 1, pipeline: 1, layers: [0, 5]}
  - {name: west1, region: west, device: cpu, threads: 1, pipeline: 1, layers: [5, 8]}
"""


def _run(tmp_path, name: str, mode: str, nodes: str, codec: str = "none"):
    pipelines = ", pipeline_microbatches: [3, 1]" if "pipeline: 1" in nodes else ""
    text = HEAD.replace("MODE", mode).replace("CODEC", codec).replace("PIPELINES", pipelines) + nodes
    yaml_path = tmp_path / f"{name}.yaml"
    yaml_path.write_text(text)
    run_dir = tmp_path / name
    result = run_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), timeout=200)
    assert result.returncode == 0, result.stderr + result.stdout
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # What each stage sent, [raw, on the wire], per kind: sealed messages carry an envelope and a tag.
    sent = [(kind, *stage["sent_bytes"][kind]) for r in lines for stage in r["stages"] for kind in stage["sent_bytes"]
            if stage["sent_bytes"][kind][0]]
    return [r["loss"] for r in lines], final_parameters(run_dir), sent


def _sealed_kinds(sent) -> set[str]:
    """The kinds of traffic whose every message carried the seal's overhead (wire > raw, codec none)."""
    kinds = {kind for kind, _, _ in sent}
    return {kind for kind in kinds if all(wire > raw for k, raw, wire in sent if k == kind)}


def _same_bits(a, b) -> None:
    (losses_a, params_a, _), (losses_b, params_b, _) = a, b
    assert losses_a == losses_b  # floats compared exactly
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name


@pytest.mark.timeout(400)
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_sealed_link_trains_bit_for_bit_like_the_clear_one(tmp_path, codec):
    clear = _run(tmp_path, "clear", "off", ONE_PIPELINE, codec)
    sealed = _run(tmp_path, "sealed", "cross_region", ONE_PIPELINE, codec)
    _same_bits(clear, sealed)
    assert len(clear[0]) == STEPS
    if codec == "none":
        assert _sealed_kinds(clear[2]) == set() and _sealed_kinds(sealed[2]) == {"forward", "backward"}


@pytest.mark.timeout(400)
def test_two_pipelines_with_everything_sealed_train_like_the_clear_run(tmp_path):
    """`all`: the links and each layer's gradient sync (a sealed all-gather between the two holders)."""
    clear, sealed = _run(tmp_path, "clear", "off", TWO_PIPELINES), _run(tmp_path, "sealed", "all", TWO_PIPELINES)
    _same_bits(clear, sealed)
    assert _sealed_kinds(clear[2]) == set() and _sealed_kinds(sealed[2]) == {"forward", "backward", "sync"}


ISLANDS = """nodes:
  - {name: east0, region: east, device: cpu, threads: 1, pipeline: 0, layers: [0, 3]}
  - {name: east1, region: east, device: cpu, threads: 1, pipeline: 0, layers: [3, 8]}
  - {name: west0, region: west, device: cpu, threads: 1, pipeline: 1, layers: [0, 8]}
"""


def _off_and_all_alike(tmp_path, train_extra: str, nodes: str) -> None:
    """The job run clear and with `encrypt: all`: the same losses and final parameters, bit for bit."""
    runs = {}
    for mode in ("off", "all"):
        text = HEAD.replace("MODE", mode).replace("CODEC", "none").replace("PIPELINES", train_extra) + nodes
        (tmp_path / f"{mode}.yaml").write_text(text)
        result = run_hetlaunch("up", str(tmp_path / f"{mode}.yaml"), "--run-dir", str(tmp_path / mode), timeout=200)
        assert result.returncode == 0, result.stderr + result.stdout
        runs[mode] = ([json.loads(line)["loss"] for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()],
                      final_parameters(tmp_path / mode), [])
    _same_bits(runs["off"], runs["all"])


def _outer_bytes(run_dir) -> list[tuple[int, int]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [tuple(r["islands"]["outer"]["bytes"]) for r in lines if r["islands"]["outer"]["bytes"][0]]


@pytest.mark.timeout(400)
def test_islands_meet_sealed_and_train_bit_for_bit_like_the_clear_run(tmp_path):
    """Two islands (east: a two-stage pipeline; west: one stage) meeting every 2 steps, streamed in
    two fragments with a delay of 1 (the sealed exchange runs on its own thread while the next
    step computes). Under `all` the outer exchange between the islands' representatives, the
    east pipeline's link, its clipping all-reduce and its barrier are all sealed."""
    _off_and_all_alike(tmp_path, ", outer: {islands: by_region, every: 2, fragments: 2, delay: 1, codec: none}",
                       ISLANDS)
    clear, sealed = _outer_bytes(tmp_path / "off"), _outer_bytes(tmp_path / "all")
    assert clear and len(clear) == len(sealed)
    assert all(wire == raw for raw, wire in clear), clear  # codec none: the deltas as they are
    assert all(wire > raw for raw, wire in sealed), sealed  # each one carried an envelope and a tag


def test_encryption_is_job_wide_and_off_across_regions_under_tls_is_acknowledged(tmp_path):
    text = HEAD.replace("MODE", "cross_region").replace("CODEC", "none").replace("PIPELINES", "") + ONE_PIPELINE
    yaml_path = tmp_path / "per_node.yaml"
    for field in ("encrypt: all", "insecure: true"):
        yaml_path.write_text(text.replace("layers: [0, 4]}", f"layers: [0, 4], data_plane: {{{field}}}}}"))
        result = run_hetlaunch("validate", str(yaml_path), timeout=60)
        assert result.returncode != 0 and "job-wide" in result.stderr + result.stdout, result.stderr + result.stdout


PLANTED_MODEL = HEAD.replace(
    f"model: {{preset: tiny, seq_len: {CFG.seq_len}, d_model: {CFG.d_model}, n_layers: {CFG.n_layers}, "
    f"n_heads: {CFG.n_heads}}}",
    'model: {entrypoint: "user_model:make_planted_lm", kwargs: {d: 32, n_hidden: 1, seq_len: 16}}')
PLANTED_NODES = """nodes:
  - {name: east0, region: east, device: cpu, threads: 1, layers: [0, 1]}
  - {name: west0, region: west, device: cpu, threads: 1, layers: [1, 3]}
"""


@pytest.mark.timeout(300)
def test_a_capture_of_the_wire_holds_the_planted_activations_only_in_clear(tmp_path):
    """Layer 0 writes a known pattern into every activation it sends across regions. Captured on
    the loopback interface the agents' data plane uses: there in clear text, nowhere when sealed."""
    pattern = struct.pack("<f", PLANTED) * PLANTED_WIDTH
    assert PLANTED_MODEL != HEAD
    seen = {}
    for mode in ("off", "cross_region"):
        yaml_path = tmp_path / f"{mode}.yaml"
        yaml_path.write_text(PLANTED_MODEL.replace("MODE", mode).replace("CODEC", "none").replace("PIPELINES", "")
                             + PLANTED_NODES)
        with PacketCapture("lo", pattern) as capture:
            result = run_hetlaunch("up", str(yaml_path), "--run-dir", str(tmp_path / mode), timeout=200)
        assert result.returncode == 0, result.stderr + result.stdout
        assert capture.packets > 100
        seen[mode] = capture.found
    assert seen == {"off": True, "cross_region": False}


ISLAND_OF_TWO = """nodes:
  - {name: east0, region: east, device: cpu, threads: 1, pipeline: 0, layers: [0, 8]}
  - {name: east1, region: east, device: cpu, threads: 1, pipeline: 1, layers: [0, 8]}
  - {name: west0, region: west, device: cpu, threads: 1, pipeline: 2, layers: [0, 8]}
"""


@pytest.mark.timeout(400)
def test_an_islands_representative_passes_the_average_on_sealed_and_the_math_is_the_clear_runs(tmp_path):
    """The east island holds two pipelines: after each outer step its representative passes the
    average on to the other holder over the island's own link, which `all` seals (a hostile review
    found it sent in clear, unauthenticated, and applied as it came). Sealed or not, every holder
    steps from the representative's average: the runs agree bit for bit."""
    outer = ", pipeline_microbatches: [2, 1, 1], outer: {islands: by_region, every: 2, codec: none}"
    _off_and_all_alike(tmp_path, outer, ISLAND_OF_TWO)
    assert len(_outer_bytes(tmp_path / "all")) >= STEPS // 2 - 1  # the islands met
