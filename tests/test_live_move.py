"""Live rebalancing: a node that slows mid-run gives layers away to its neighbours at a step
boundary, over the data plane, in the running workers (no restart, no checkpoint read), and the
steps compute what one process training the whole model computes."""

from __future__ import annotations

import json
import subprocess
import threading

import psutil
import pytest
import torch
import yaml

from conftest import hetlaunch_cmd, hetlaunch_env, run_gloo_ranks
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.layer_transfer import exchange
from hetlaunch.runtime.transfer_plan import TransferError, transfers

SLOW_AT = 40
STEPS = 120
MODEL = {"preset": "tiny", "n_layers": 6, "seq_len": 32, "d_model": 32}
# No checkpoints: a restart has nothing to start from, so only a live move can answer the straggler.
TRAIN = {"steps": STEPS, "micro_batch_size": 4, "num_microbatches": 8, "max_pipelines": 1, "checkpoint_every": 0}


def _place(rank: int, start: int, end: int, pipeline: int = 0) -> pb.StagePlace:
    return pb.StagePlace(rank=rank, pipeline=pipeline, layer_start=start, layer_end=end)


def test_transfers_come_from_the_old_holder_in_the_same_pipeline_in_one_order():
    old = [_place(0, 0, 2), _place(1, 2, 4), _place(2, 4, 8), _place(3, 0, 4, 1), _place(4, 4, 8, 1)]
    new = [_place(0, 0, 3), _place(1, 3, 6), _place(2, 6, 8), _place(3, 0, 4, 1), _place(4, 4, 8, 1)]
    assert [(t.layer, t.src, t.dst) for t in transfers(old, new)] == [(2, 1, 0), (4, 2, 1), (5, 2, 1)]
    with pytest.raises(TransferError, match="keeps every rank in its pipeline"):
        transfers(old, [_place(0, 0, 8, 1)] + new[1:])


def _exchange_rank(rank: int, out_dir: str) -> None:
    """Three ranks: [0,2) [2,3) [3,6) become [0,1) [1,4) [4,6); every tensor arrives bit for bit."""
    old = [_place(0, 0, 2), _place(1, 2, 3), _place(2, 3, 6)]
    new = [_place(0, 0, 1), _place(1, 1, 4), _place(2, 4, 6)]
    def state_of(layer: int) -> dict:
        g = torch.Generator().manual_seed(layer)
        return {f"layers.{layer}.w": torch.randn(3, 5, generator=g),
                f"layers.{layer}.ln.bias": torch.randn(5, generator=g).to(torch.bfloat16),
                f"optim.{layer}.w.step": torch.tensor(7.0),
                f"optim.{layer}.w.exp_avg": torch.randn(3, 5, generator=g)}
    held = {}
    for layer in range(old[rank].layer_start, old[rank].layer_end):
        held.update(state_of(layer))
    received, sent, got = exchange(transfers(old, new), rank, held, torch.device("cpu"))
    expected = {}
    for layer in range(new[rank].layer_start, new[rank].layer_end):
        if not old[rank].layer_start <= layer < old[rank].layer_end:
            expected.update(state_of(layer))
    assert set(received) == set(expected), (rank, sorted(received))
    for key, tensor in expected.items():
        assert received[key].dtype == tensor.dtype and torch.equal(received[key], tensor), key
    assert (sent > 0) == (rank in (0, 2)) and (got > 0) == (rank == 1)


@pytest.mark.timeout(120)
def test_layers_move_between_three_real_gloo_ranks_bit_for_bit(tmp_path):
    run_gloo_ranks(_exchange_rank, 3, tmp_path)


def _cluster(nodes: list[dict]) -> dict:
    return {"name": "live", "model": MODEL, "train": TRAIN, "nodes": nodes}


def _node(name: str, speed: float, slow: bool = False) -> dict:
    emulate = {"speed": speed}
    if slow:
        emulate["speed_changes"] = [{"at_step": SLOW_AT, "speed": round(speed * 0.3, 6)}]
    return {"name": name, "device": "cpu", "threads": 1, "emulate": emulate}


def _workers_of(root: psutil.Process) -> set[int]:
    found = set()
    for child in root.children(recursive=True):
        try:
            if "hetlaunch.runtime.worker" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            pass
    return found


def _up(tmp_path, name: str, cluster: dict, watch_workers: bool = False):
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / name
    proc = subprocess.Popen(hetlaunch_cmd("up", str(tmp_path / f"{name}.yaml"), "--run-dir", str(run_dir)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=hetlaunch_env(),
                            cwd=tmp_path)
    seen: list[tuple[int, set[int]]] = []  # (steps reported so far, worker pids alive then)
    stop = threading.Event()

    def watch() -> None:
        root = psutil.Process(proc.pid)
        metrics = run_dir / "metrics.jsonl"
        while not stop.wait(0.2):
            steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            seen.append((steps, _workers_of(root)))
    watcher = threading.Thread(target=watch, daemon=True)
    if watch_workers:
        watcher.start()
    try:
        out, err = proc.communicate(timeout=280)
    finally:
        stop.set()
        proc.kill()
    assert proc.returncode == 0, err + out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return metrics, events, json.loads((run_dir / "summary.json").read_text()), seen


@pytest.mark.timeout(400)
def test_a_node_slowing_to_a_third_gives_layers_away_live_and_the_losses_equal_one_process(tmp_path):
    cluster = _cluster([_node("a", 0.25), _node("b", 0.25, slow=True), _node("c", 0.25)])
    metrics, events, summary, seen = _up(tmp_path, "slow", cluster, watch_workers=True)
    found = [e for e in events if e["event"] == "straggler"]
    assert found and found[0]["node"] == "b" and found[0]["step"] >= SLOW_AT and found[0]["mode"] == "live", found
    move = next(e for e in events if e["event"] == "move")
    before = {node: (start, end) for node, start, end in move["ranges_before"]}
    after = {node: (start, end) for node, start, end in move["ranges_after"]}
    assert after["b"][1] - after["b"][0] < before["b"][1] - before["b"][0], move
    assert move["bytes_moved"] > 0 and SLOW_AT < move["step"] < STEPS, move
    # No restart, no new generation, no checkpoint read: the same three workers ran every step.
    assert not [e for e in events if e["event"] in ("restart", "restore")], events
    assert len([e for e in events if e["event"] == "generation"]) == 1 and summary["restarts"] == 0
    assert summary["plan"]["source"] == "live move"
    assert {s["node"]: (s["layer_start"], s["layer_end"]) for s in summary["plan"]["stages"]} == after
    training = [pids for steps, pids in seen if 0 < steps < STEPS]
    assert training and any(steps > move["step"] + 1 for steps, _ in seen), seen[-3:]
    assert all(pids == training[0] for pids in training) and len(training[0]) == 3, seen

    single, _, _, _ = _up(tmp_path, "single", _cluster([_node("solo", 1.0)]))
    assert [m["step"] for m in metrics] == list(range(STEPS)) == [m["step"] for m in single]
    for moved, alone in zip(metrics, single):  # the move changes who computes what, not the math
        assert moved["loss"] == pytest.approx(alone["loss"], rel=1e-5), (moved["step"], moved["loss"], alone["loss"])


@pytest.mark.timeout(400)
def test_a_live_move_across_two_pipelines_rebuilds_their_gradient_sync_and_keeps_the_math(tmp_path):
    """Against the same two pipelines without the move (rebalance: off): two pipelines sum their
    gradients in another order than one process does, and this small model amplifies that float
    difference after ~30 steps (1e-4 at step 33 with or without a move), so one process is no
    reference here; the run the move interrupted is."""
    train = {**TRAIN, "steps": 80, "max_pipelines": 2}
    nodes = [_node("a", 0.25), _node("b", 0.25), _node("c", 0.25), _node("d", 0.25)]
    nodes[1]["emulate"]["speed_changes"] = [{"at_step": 30, "speed": 0.06}]
    metrics, events, summary, _ = _up(tmp_path, "dp", {"name": "live", "model": MODEL, "train": train, "nodes": nodes})
    first = next(e["plan"] for e in events if e["event"] == "generation")
    assert len(first["pipeline_microbatches"]) == 2 and first["sync"], first  # two pipelines that sync gradients
    move = next(e for e in events if e["event"] == "move")
    assert move["ranges_after"] != move["ranges_before"] and summary["restarts"] == 0, move
    assert summary["plan"]["sync"] != first["sync"]  # the sync groups follow the new cut
    still, still_events, _, _ = _up(tmp_path, "off", {"name": "live", "model": MODEL,
                                                      "train": {**train, "rebalance": "off"}, "nodes": nodes})
    unmoved = next(e["plan"] for e in still_events if e["event"] == "generation")
    assert unmoved["pipeline_microbatches"] == first["pipeline_microbatches"]  # the same global batch split
    assert not [e for e in still_events if e["event"] == "move"]
    assert [m["step"] for m in metrics] == list(range(80)) == [m["step"] for m in still]
    for moved, alone in zip(metrics, still):
        assert moved["loss"] == pytest.approx(alone["loss"], rel=1e-5), (moved["step"], moved["loss"], alone["loss"])
