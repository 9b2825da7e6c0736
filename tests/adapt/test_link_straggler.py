"""A link that slows mid-run (`bandwidth_changes`, never profiled) is found from the transits the
stages report, its bandwidth is estimated, and the job plans again with it."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import run_hetlaunch
from hetlaunch.launcher.cluster_yaml import ConfigError, parse_cluster
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.emulation import WireEmulation

SLOW_AT, STEPS, MBPS = 25, 60, 4.0


def _cluster(slow_at: int = SLOW_AT, mbps: float = MBPS) -> dict:
    return {"name": "slowlink", "model": {"preset": "tiny", "n_layers": 4, "seq_len": 32, "d_model": 32},
            "train": {"steps": STEPS, "micro_batch_size": 4, "num_microbatches": 8, "max_pipelines": 1,
                      "checkpoint_every": 0},
            "compression": {"intra_region": "none", "cross_region": "none"},
            "links": [{"between": ["r0", "r1"], "emulate": {"bandwidth_mbps": 200, "latency_ms": 1,
                       "bandwidth_changes": [{"at_step": slow_at, "bandwidth_mbps": mbps}]}}],
            "nodes": [{"name": "a", "region": "r0", "device": "cpu", "threads": 1, "emulate": {"speed": 0.25}},
                      {"name": "b", "region": "r1", "device": "cpu", "threads": 1, "emulate": {"speed": 0.25}}]}


def test_bandwidth_changes_must_increase_and_apply_from_their_step():
    cluster = _cluster()
    cluster["links"][0]["emulate"]["bandwidth_changes"] = [{"at_step": 5, "bandwidth_mbps": 1},
                                                          {"at_step": 5, "bandwidth_mbps": 2}]
    with pytest.raises(ConfigError, match="at_step must increase"):
        parse_cluster(yaml.safe_dump(cluster), "c.yaml")
    spec = pb.LinkSpec(emulate_bandwidth_mbps=200, bandwidth_changes=[pb.BandwidthChange(at_step=5, bandwidth_mbps=8)])
    wire = WireEmulation.from_spec(0, 0, changes=True)
    wire.at_step(spec, 4)
    assert wire.bandwidth_bytes_per_s == 200e6 / 8
    wire.at_step(spec, 5)
    assert wire.bandwidth_bytes_per_s == 1e6


@pytest.mark.solo
@pytest.mark.timeout(300)
def test_a_link_slowing_mid_run_is_found_and_its_bandwidth_estimated(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_cluster()))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir), timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    # The first slow link found once it slowed, at whichever step (a passing burst of load may
    # make the watch see something before; that is not what is checked here).
    link = next((e for e in events if e["event"] == "straggler" and "link" in e and e["step"] >= SLOW_AT), None)
    assert link is not None and set(link["link"]) == {"a", "b"}, events
    # What the link was believed to carry before: the profile as calibration corrected it from the
    # first steps' transits. Alone that reads above 50 Mbit/s (200 emulated); in two serial full-suite
    # runs on 2026-12-03 it read 34.7 and 15.8 (not understood yet). What is checked is the change:
    # the watch's estimate is less than half of what the link was believed to carry.
    assert MBPS / 2 <= link["bandwidth_mbps"] <= MBPS * 2, link
    assert link["profiled_mbps"] > 2 * link["bandwidth_mbps"], link
    assert "carries" in link["what"]
    factors = json.loads((run_dir / "calibration.json").read_text())["link_transit_factors"]
    assert len(factors) == 1, factors  # the one boundary's transit, steps 1-8
    # The transits the stages reported show the change: 50x less bandwidth, against the link's own
    # time before it, its least transit (load only ever adds to a transit: in a run after the other
    # tests of tests/adapt the steps before the slowdown read 2.5 to 59 ms, their median 5x the least).
    second = next(s["node"] for s in metrics[0]["stages"] if s["stage"] == 1)
    transit = [next(s for s in m["stages"] if s["node"] == second)["transit"]["from_prev"][0] for m in metrics]
    assert min(transit[SLOW_AT + 1:SLOW_AT + 5]) > 5 * min(transit[5:SLOW_AT - 1]), transit


@pytest.mark.solo
@pytest.mark.timeout(300)
def test_calibration_corrects_a_link_profiled_faster_than_it_trains(tmp_path):
    # 2 Mbit/s, not 4: the link must outweigh the compute even where the profile read the 200 Mbit/s
    # link slow (a loaded CI machine profiled it at ~30 Mbit/s and the profiled plan was then only
    # 24% off at 4 Mbit/s; alone, at 4 Mbit/s, it is 47% off).
    mbps = MBPS / 2
    cluster = _cluster(slow_at=0, mbps=mbps)
    cluster["train"]["steps"] = 30
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir), timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    calibration = json.loads((run_dir / "calibration.json").read_text())
    (link, factor), = calibration["link_transit_factors"].items()
    assert factor > 5 and mbps / 2 <= calibration["links_corrected"][link] <= mbps * 2, calibration
    # On the calibration window's own steps (later ones a shared machine runs 15-30% off), with the
    # nodes' speeds calibrated alike on both sides (a busy machine moves them either way: 0.58x-1.4x
    # of the profile seen beside a busy loop): the plan priced with the profiled link was far off, the
    # one priced with the measured link much closer.
    measured = calibration["measured_step_s"]
    before = (calibration["compute_calibrated_step_s"] - measured) / measured
    corrected = (calibration["calibrated_step_s"] - measured) / measured
    assert before < -0.3 and abs(corrected) < abs(before) / 2, calibration
    assert "measured transit ÷ predicted per link" in result.stdout
