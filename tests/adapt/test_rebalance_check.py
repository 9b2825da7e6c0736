"""Rebalancing that checks itself: a live move or a switch to another plan is measured on the
steps after it against as many before it, and undone when it did not pay.

The judge and the straggler watch are fed step reports whose figures the test chose; the run
at the end makes a change that cannot pay whatever the timing (a node that is faster only until
right after the move was decided, and slower from then on), and checks the decision against the
steps it measured."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from conftest import run_hetlaunch
from rebalance_fixtures import step, watched
from hetlaunch.launcher.adapt.payoff import CHECK_STEPS, COOLDOWN_STEPS, MIN_GAIN, Change, Review, judge
from hetlaunch.launcher.adapt.straggler import K
from hetlaunch.launcher.run_record import StepRecord


def _steps(first: int, tokens_per_s: list[float]) -> list[StepRecord]:
    return [StepRecord(step=first + i, loss=1.0, tokens_per_s=t, step_s=1 / t, stages=[])
            for i, t in enumerate(tokens_per_s)]


def test_the_judge_compares_medians_and_wants_one_percent_more():
    before = _steps(0, [100, 100, 100, 5, 100])  # one step stalled: the median does not see it
    assert judge(before, _steps(6, [101, 101, 500, 101, 101])).paid  # 1% more, one lucky step aside
    verdict = judge(before, _steps(6, [100.9] * 5))
    assert not verdict.paid and verdict.before_tokens_per_s == 100 and verdict.after_tokens_per_s == 100.9
    assert verdict.figures()["gain"] == pytest.approx(0.009) and verdict.figures()["before_steps"] == [0, 1, 2, 3, 4]
    assert MIN_GAIN == 0.01


def _change(watch_plan, mode: str = "live") -> Change:
    return Change(mode, watch_plan, watch_plan, "why", 0)


def test_a_live_move_is_judged_on_as_many_steps_after_its_landing_as_before_it():
    _, _, plan = watched({"a": 0.01, "b": 0.01})
    review = Review()
    review.new_generation(0)
    for record in _steps(0, [999] + [100] * 11):  # step 0 is the generation's warm-up
        assert review.add(record) is None
    # The move lands before step 12; steps 12 and 13 were reported before the coordinator knew.
    assert review.add(_steps(12, [1])[0]) is None and review.add(_steps(13, [150])[0]) is None
    review.landed(_change(plan), 12)
    assert review.checking
    results = [review.add(r) for r in _steps(14, [150] * (CHECK_STEPS - 1))]
    change, verdict = results[-1]
    assert results[:-1] == [None] * (CHECK_STEPS - 2) and verdict.paid and not review.checking
    assert verdict.before_steps == tuple(range(12 - CHECK_STEPS, 12))  # the last ones before the landing
    assert verdict.after_steps == tuple(range(13, 13 + CHECK_STEPS))  # the landing step (transfers) left out


def test_a_switch_at_a_checkpoint_is_judged_on_its_new_generation_only():
    _, _, plan = watched({"a": 0.01, "b": 0.01})
    review = Review()
    review.new_generation(0)
    for record in _steps(0, [100] * 14):  # the old plan ran past the checkpoint of step 10 ...
        review.add(record)
    review.new_generation(10)  # ... and its steps 10-13 run again: they do not count
    review.landed(_change(plan, "restart"), 10)
    assert review.add(_steps(10, [1])[0]) is None  # the new generation's first step: its warm-up
    results = [review.add(r) for r in _steps(11, [90] * CHECK_STEPS)]
    _, verdict = results[-1]
    assert not verdict.paid and verdict.before_steps == tuple(range(10 - CHECK_STEPS, 10))
    assert verdict.after_steps == tuple(range(11, 11 + CHECK_STEPS))


def test_a_change_with_few_steps_before_it_is_judged_on_as_few_after_and_an_undo_not_at_all():
    _, _, plan = watched({"a": 0.01, "b": 0.01})
    review = Review()
    review.new_generation(0)
    for record in _steps(0, [100] * 4):
        review.add(record)
    review.landed(_change(plan), 4)
    assert [review.add(r) is None for r in _steps(5, [50] * 3)] == [True, True, False]
    review.landed(_change(plan).undone("back", 9), 9)
    assert not review.checking and all(review.add(r) is None for r in _steps(9, [50] * 20))


def test_an_undone_change_is_not_made_again_within_its_cool_down():
    _, _, plan = watched({"a": 0.01, "b": 0.01})
    _, _, other = watched({"a": 0.01, "b": 0.03})
    review = Review()
    change = Change("live", plan, other, "why", 3)
    assert review.refuse(change, 20) == 20 + COOLDOWN_STEPS
    assert review.refused(plan, other, 20 + COOLDOWN_STEPS - 1) and not review.refused(plan, other, 20 + COOLDOWN_STEPS)
    assert not review.refused(other, plan, 21)  # the way back is another change


def test_a_live_move_that_did_not_pay_is_moved_back_and_not_made_again_for_a_while():
    """The decision logic on fed step reports: b is found twice as slow and gets fewer layers;
    the steps after the move run no faster than before it, so the layers move back, the watch
    expects of the old cut what it did before, and the same move is not made again until its
    cool-down is over."""
    fast = {"a": 0.01, "b": 0.01, "c": 0.01}
    slow = {**fast, "b": 0.02}
    watch, current, before = watched(fast)
    assert _found(watch, before, 1, slow)["mode"] == "live"
    change = watch.take()
    assert change.target.stages[1].num_layers < before.stages[1].num_layers
    for n in range(1 + K, 4 + K):  # the hold: the old cut still runs
        assert watch.add(step(n, before, slow, 100.0)) is None
    landing = 4 + K
    current.moved(change.target)
    watch.moved(landing)
    results = [watch.add(step(n, change.target, slow, 100.5)) for n in range(landing, landing + 1 + CHECK_STEPS)]
    name, figures = results[-1]
    assert results[:-1] == [None] * CHECK_STEPS and name == "rebalance_undone"
    assert figures["before_tokens_per_s"] == 100.0 and figures["after_tokens_per_s"] == 100.5  # 0.5%: not enough
    assert figures["before_steps"] == list(range(landing - CHECK_STEPS, landing)) and figures["decided_at"] == K
    judged_at = landing + CHECK_STEPS
    assert figures["not_again_before_step"] == judged_at + COOLDOWN_STEPS

    back = watch.take()
    assert back.undo and back.mode == "live" and back.target is before and back.previous is change.target
    current.moved(back.target)
    n = judged_at + 2
    watch.moved(n)
    # Back on the old cut the watch expects b at the speed it found: no straggler, nothing checked.
    assert [watch.add(step(n + i, before, slow, 100.0)) for i in range(2 * K)] == [None] * 2 * K
    n += 2 * K
    # b is as fast as the others again (the old cut is the best for that), then twice as slow
    # again: the move that did not pay is not made again in its cool-down ...
    assert _found(watch, before, n, fast)["mode"] is None
    again = _found(watch, before, n + K, slow)
    assert again["refused"] == ["live"] and again["mode"] is None and watch.pending is None, again
    # ... and is once the cool-down is over.
    assert _found(watch, before, judged_at + COOLDOWN_STEPS, fast)["mode"] is None
    later = _found(watch, before, judged_at + COOLDOWN_STEPS + K, slow)
    assert later["mode"] == "live" and "refused" not in later
    assert [(s.node, s.layer_start, s.layer_end) for s in watch.take().target.stages] == \
        [(s.node, s.layer_start, s.layer_end) for s in change.target.stages]


def _found(watch, plan, first: int, per_layer: dict[str, float]) -> dict:
    """K steps of `plan` from step `first`: the straggler found at the last of them."""
    results = [watch.add(step(first + i, plan, per_layer, 100.0)) for i in range(K)]
    assert results[:-1] == [None] * (K - 1) and results[-1][0] == "straggler", results
    assert results[-1][1]["node"] == "b", results[-1]
    return results[-1][1]


def test_a_switch_that_did_not_pay_is_switched_back_at_the_next_checkpoint():
    watch, current, before = watched({"a": 0.01, "b": 0.01, "c": 0.01}, checkpoint_every=5, rebalance="restart",
                                     steps=400)
    slow = {"a": 0.01, "b": 0.03, "c": 0.01}
    events = [e for n in range(1, 1 + K) if (e := watch.add(step(n, before, slow, 100.0)))]
    assert [(name, e["mode"]) for name, e in events] == [("straggler", "restart")], events
    change = watch.take()
    for n in range(1 + K, 10):
        watch.add(step(n, before, slow, 100.0))
    watch.new_generation(current.launch(change.target), 10)  # the switch, at the checkpoint of step 10
    results = [watch.add(step(n, change.target, slow, 80.0)) for n in range(10, 11 + CHECK_STEPS)]
    name, figures = results[-1]
    assert name == "rebalance_undone" and figures["mode"] == "restart" and figures["gain"] == pytest.approx(-0.2)
    back = watch.take()
    assert back.undo and back.mode == "restart" and back.target is before
    watch.new_generation(current.launch(back.target), 20)
    # the old plan is watched against what was expected of it before the switch (b three times slower)
    assert [watch.add(step(n, before, slow, 100.0)) for n in range(20, 20 + 2 * K)] == [None] * 2 * K
    assert not watch.review.checking


# --- A real run: a change that cannot pay ----------------------------------------------------
# c computes four times as fast from step FAST_AT until just after the move that answers it can
# have been decided (found after K steps of it, at step FAST_AT + K - 1 at the earliest; a move
# lands two steps after it is decided at the earliest), then at half its first speed. The first
# cut is pinned (embedding + 3 blocks | 4 blocks | 3 blocks + head, one pipeline). The move gives
# c more than twice its layers, which from FAST_UNTIL on it computes at half speed: the steps
# after the move take over twice as long as the old cut's, whatever c's speed in the steps before
# it (c slow there too costs the old cut at most its 4 layers at half speed), so whenever the move
# lands the check sees it lose, by more than a busy machine's swings between one window of 8
# steps and the next (up to 1.5x here). What is asserted is the decision on the steps the run measured.
FAST_AT, FAST_UNTIL, STEPS = 12, 19, 45


def _cluster() -> dict:
    def node(name: str, layers: list[int], **emulate) -> dict:
        return {"name": name, "device": "cpu", "threads": 1, "layers": layers, "emulate": {"speed": 0.25, **emulate}}
    return {"name": "payoff", "model": {"preset": "tiny", "n_layers": 10, "seq_len": 32, "d_model": 64},
            "train": {"steps": STEPS, "micro_batch_size": 4, "num_microbatches": 8, "max_pipelines": 1,
                      "checkpoint_every": 0},  # only a live move can answer
            "nodes": [node("a", [0, 4]), node("b", [4, 8]),
                      node("c", [8, 12], speed_changes=[{"at_step": FAST_AT, "speed": 1.0},
                                                       {"at_step": FAST_UNTIL, "speed": 0.125}])]}


def _median_tokens(metrics: list[dict], steps: list[int]) -> float:
    return statistics.median(metrics[s]["tokens_per_s"] for s in steps)


@pytest.mark.solo
@pytest.mark.timeout(400)
def test_a_live_move_that_cannot_pay_is_moved_back_on_what_the_steps_measured(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_cluster()))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir), timeout=380, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))

    # Every change checked was kept or undone as the judge says on the steps it names.
    checked = [e for e in events if e["event"] in ("rebalance_kept", "rebalance_undone")]
    for e in checked:
        assert len(e["before_steps"]) == len(e["after_steps"]) and max(e["before_steps"]) < min(e["after_steps"]), e
        before, after = _median_tokens(metrics, e["before_steps"]), _median_tokens(metrics, e["after_steps"])
        assert (e["before_tokens_per_s"], e["after_tokens_per_s"]) == (pytest.approx(before, abs=1e-3),
                                                                       pytest.approx(after, abs=1e-3)), e
        assert (e["event"] == "rebalance_kept") == (after >= (1 + MIN_GAIN) * before), e

    # c found faster, answered with a move that gives it layers, undone, and the layers moved back.
    fast = next(e for e in events if e["event"] == "straggler" and e.get("node") == "c" and e["step"] >= FAST_AT)
    assert fast["speed_vs_calibrated"] > 1.5 and fast["mode"] == "live" and fast["step"] < FAST_UNTIL, fast
    moves = [e for e in events if e["event"] == "move"]
    move = next(m for m in moves if m["step"] > fast["step"])
    layers = {node: end - start for node, start, end in move["ranges_after"]}
    assert layers["c"] > 4 and move["step"] >= FAST_AT + K + 1, move
    undone = next(e for e in checked if e["decided_at"] == fast["step"])
    assert undone["event"] == "rebalance_undone" and undone["mode"] == "live", undone
    assert min(undone["after_steps"]) > move["step"] and max(undone["before_steps"]) < move["step"]
    assert undone["after_tokens_per_s"] < 0.8 * undone["before_tokens_per_s"], undone  # c's extra layers, at half speed
    back = next(m for m in moves if m["step"] > undone["step"])
    assert back["ranges_after"] == move["ranges_before"], (move, back)
    rebalances = [e for e in events if e["event"] == "rebalance"]
    assert any(e.get("undo") and e["step"] == undone["step"] for e in rebalances), rebalances
    output = result.stdout + result.stderr
    assert "rebalancing: node c runs at" in output and "moving the layers back" in output, output
    assert "recovering" not in output
