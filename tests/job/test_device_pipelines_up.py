"""`hetlaunch up` with two pipelines of a several-stages-per-node schedule: `train.schedule: zb-v`
(or interleaved-1f1b) and `max_pipelines: 2` on four local nodes trains exactly as one process
would (tests/single_process_reference.py): per-step losses and final parameters rel <= 1e-5.

The plan must not depend on this machine's load, so the layer timings it plans from are set: the
nodes are measured once into a profile cache of this module's own (one entry, the four nodes
alike), and the entry's timings replaced by 100 ms a layer. On 8 equal layers and 4 micro-batches
1F1B's planner then takes two pipelines of two nodes, two micro-batches each (priced 1.2 s a
step, where one pipeline over all four nodes is 1.75 s and two pipelines of one node 1.6 s), and
each pipeline is cut into four stages of two layers by the device planner. The run goes at the
machine's speed; what it computes does not depend on the timings.

Why 1e-5: every layer computes the same fp32 arithmetic as in one process; what differs is the
order in which a parameter's gradient sums its micro-batches (each pipeline's two, then the
pipelines' sums added by the sync) and the clipping norm's sum (over the nodes' parts, halved for
two replicas), reordered fp32 sums about 1e-7 relative, well under 1e-5 after six AdamW steps.

Also here: int8 pinned on a boundary of both schedules against 1F1B with the same codec at the
same layer, and a lost node of two ZB-V pipelines re-planned and resumed from the checkpoint.
"""

from __future__ import annotations

import copy
import json
import signal

import pytest
import torch
import yaml

from conftest import final_parameters, run_hetlaunch
from fault_run import agent_process, events as fault_events, run_and_hurt
from fixed_profile_cache import fixed_timings_env
from single_process_reference import (CFG, CLIP, DATA_SEED, LR, MICRO_BATCH, MIN_LR_RATIO, NUM_MICRO, SEED, STEPS,
                                      WARMUP, WEIGHT_DECAY)


def _cluster(schedule: str) -> dict:
    nodes = [{"name": f"n{i}", "device": "cpu", "threads": 1} for i in range(4)]
    return {"name": "dev-pipelines",
            "coordinator": {"host": "127.0.0.1", "port": 0, "join_timeout_s": 60, "heartbeat_timeout_s": 4},
            "model": {"preset": "tiny", "seq_len": CFG.seq_len, "d_model": CFG.d_model, "n_layers": CFG.n_layers,
                      "n_heads": CFG.n_heads},
            "data": {"seed": DATA_SEED},
            "train": {"steps": STEPS, "micro_batch_size": MICRO_BATCH, "num_microbatches": NUM_MICRO,
                      "schedule": schedule, "max_pipelines": 2, "lr": LR, "weight_decay": WEIGHT_DECAY, "seed": SEED,
                      "lr_schedule": "cosine", "warmup_steps": WARMUP, "min_lr_ratio": MIN_LR_RATIO,
                      "grad_clip": CLIP, "checkpoint_every": STEPS, "rebalance": "off"},
            "observe": {"trace_every": 0},
            "compression": {"intra_region": "none", "cross_region": "none", "sync": "none"},
            "nodes": nodes}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict[str, str]:
    """The environment of a profile cache whose one entry holds equal, fixed layer timings."""
    return fixed_timings_env(tmp_path_factory.mktemp("cache"), yaml.safe_dump(_cluster("zb-v")), CFG.n_layers + 2)


@pytest.fixture(scope="module")
def reference():
    from single_process_reference import reference_training

    return reference_training()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_two_pipelines_of_a_device_schedule_equal_single_process_training(tmp_path, cache, reference, schedule):
    cluster = _cluster(schedule)
    cluster["observe"]["trace_every"] = 3  # steps 0 and 3 traced: the arithmetic is the same
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(path), "--run-dir", str(run_dir), timeout=400, env=cache, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    plan = next(e for e in events if e["event"] == "generation")["plan"]
    assert plan["schedule"] == schedule and plan["pipeline_microbatches"] == [2, 2], plan
    # two pipelines of two nodes, four stages each, placed as the schedule says
    where = [0, 1, 1, 0] if schedule == "zb-v" else [0, 1, 0, 1]
    chains = []
    for p in (0, 1):
        nodes = [s["node"] for s in plan["stages"] if s["pipeline"] == p]
        chain = list(dict.fromkeys(nodes))
        assert len(chain) == 2 and nodes == [chain[d] for d in where], plan["stages"]
        chains.append(chain)
    assert sorted(chains[0] + chains[1]) == ["n0", "n1", "n2", "n3"]
    assert plan["sync"], plan  # the pipelines' gradient sync groups
    ref_losses, ref_params = reference
    assert [r["step"] for r in metrics] == list(range(STEPS))
    for got, want in zip((r["loss"] for r in metrics), ref_losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert all(r["grad_norm"] > CLIP for r in metrics)  # the clip acted on the whole model's norm
    params = final_parameters(run_dir)  # pipeline 0's stages write the checkpoint, a part per stage
    assert params.keys() == ref_params.keys()
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)
    # trace.json: a process per pipeline, a track per node of it, each with its worker's actions
    trace = json.loads((run_dir / "trace.json").read_text())
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    for p, chain in enumerate(chains):
        for d, node in enumerate(chain):
            assert names[(p, d)].startswith(f"{node} (default): stages "), names
            forwards = [e for e in trace["traceEvents"] if e.get("ph") == "X" and (e["pid"], e["tid"]) == (p, d)
                        and e["args"]["step"] == 3 and e["name"].startswith("F")]
            assert len(forwards) == 2 * 2, (p, d, forwards)  # its two stages' forwards of the pipeline's two
    # every node synced: each holds layers of some sync group, in whichever of its stages
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {entry["node"] for entry in summary["gradient_sync"]} == {"n0", "n1", "n2", "n3"}


def _run(tmp_path, name: str, cluster: dict, env: dict | None = None) -> tuple[list[dict], dict, dict]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / f"run-{name}"
    result = run_hetlaunch("up", str(path), "--run-dir", str(run_dir), timeout=400, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "summary.json").read_text())["plan"]
    return metrics, plan, final_parameters(run_dir)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_two_pipelines_with_int8_on_a_boundary_equal_1f1b_with_the_same_codec(tmp_path, cache, schedule):
    """`compression.boundaries: {0: int8}` names the schedule's boundary after stage 0 (node to
    node) in each pipeline. The reference is 1F1B with the same arithmetic: two pipelines of two micro-batches
    each, every pipeline cut after layer 1 with int8 there (its other layers on one node: a link
    without a codec moves the tensor as it is). int8 rounds each micro-batch's activation and
    gradient on its own, so where the other cuts are changes nothing it computes, and with two
    micro-batches a pipeline's gradient sum does not depend on their order. Clipping is off here:
    its norm sums the nodes' parts, which differ between the two plans, and a last-bit change of a
    weight can move an int8 rounding, which AdamW carries into the weights past 1e-5 (so it went
    with clipping on against 1F1B as one pipeline: losses within 1e-5, a few weights up to 3e-5
    apart). Per-step losses and final parameters rel <= 1e-5, and the boundary ran int8."""
    device = _cluster(schedule)
    device["compression"]["boundaries"] = {0: "int8"}
    device["train"]["grad_clip"] = 0.0
    metrics, plan, params = _run(tmp_path, schedule, device, cache)
    assert plan["pipeline_microbatches"] == [2, 2]
    cuts = [[(s["layer_start"], s["layer_end"]) for s in plan["stages"] if s["pipeline"] == p] for p in (0, 1)]
    assert cuts[0][0] == cuts[1][0] == (0, 2), cuts
    assert [s["forward_codec"] for s in plan["stages"]] == ["int8", "none", "none", "none"] * 2
    one_f_one_b = copy.deepcopy(device)
    train = one_f_one_b["train"]
    train.update(schedule="1f1b", pipeline_microbatches=[2, 2])
    del train["max_pipelines"]
    for i, node in enumerate(one_f_one_b["nodes"]):
        node.update(pipeline=i // 2, layers=[0, 2] if i % 2 == 0 else [2, CFG.n_layers + 2])
    want, _, want_params = _run(tmp_path, "1f1b", one_f_one_b)
    losses = [r["loss"] for r in metrics]
    for got, ref in zip(losses, (r["loss"] for r in want), strict=True):
        assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    assert params.keys() == want_params.keys()
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    sent = [r for r in metrics[-1]["stages"] if r["stage"] == 0]
    assert all(0 < r["sent_bytes"]["forward"][1] < 0.3 * r["sent_bytes"]["forward"][0] for r in sent), sent


@pytest.mark.timeout(600)
def test_a_lost_node_of_two_zb_v_pipelines_resumes_from_the_checkpoint_on_a_new_plan(tmp_path, cache, reference,
                                                                                   monkeypatch):
    """A node of pipeline 1 is killed once step 3 is logged: the job re-plans ZB-V (max_pipelines
    2) on the three nodes left, resumes from the newest checkpoint (these workers write no replica
    snapshots), and logs every step once, each the single-process loss."""
    monkeypatch.setenv("HETLAUNCH_CACHE_DIR", cache["HETLAUNCH_CACHE_DIR"])  # run_and_hurt's `up` reads os.environ
    cluster = _cluster("zb-v")
    cluster["train"]["checkpoint_every"] = 2
    cluster["coordinator"].update(heartbeat_interval_s=0.5, heartbeat_timeout_s=10)
    # Steps 3 and 4 run at 1/200 of the nodes' speed (a sleep, seconds a step), so the kill, made
    # once step 3 is logged, lands before the last step even when the coordinator logs steps late:
    # at a tenth of the speed CI once logged step 3 after step 5 had ended, and the kill found the
    # job done. The stretch scales with the time compute took, so a load that delays the log
    # lengthens these steps too. Step 5 is quick again (the resumed generation re-runs 2 or 4 on).
    # The profile cache's key is the speed before any change.
    for node in cluster["nodes"]:
        node["emulate"] = {"speed_changes": [{"at_step": 3, "speed": 0.005}, {"at_step": 5, "speed": 1.0}]}
    victim = {}

    def kill_a_node_of_pipeline_1() -> None:
        plan = next(e for e in fault_events(tmp_path / "run") if e["event"] == "generation")["plan"]
        victim["node"] = [s["node"] for s in plan["stages"] if s["pipeline"] == 1][1]  # its stage 1's node
        agent_process(victim["node"]).send_signal(signal.SIGKILL)
    run_dir, rc, output, _ = run_and_hurt(tmp_path, yaml.safe_dump(cluster), kill_a_node_of_pipeline_1, at_step=3,
                                          timeout=300)
    assert rc == 0, output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS)), "a step is missing or logged twice"
    events = fault_events(run_dir)
    assert [e["node"] for e in events if e["event"] == "lost"] == [victim["node"]]
    generations = [e for e in events if e["event"] == "generation"]
    assert len(generations) == 2 and generations[1]["plan"]["schedule"] == "zb-v"
    assert victim["node"] not in {s["node"] for s in generations[1]["plan"]["stages"]}
    # from the newest checkpoint (step 2 or 4: the steps are quick, step 4's may be written by then)
    (restore,) = [e for e in events if e["event"] == "restore"]
    assert restore["source"] == "file" and restore["step"] in (2, 4), restore
    ref_losses, _ = reference
    for got, want in zip((r["loss"] for r in records), ref_losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
