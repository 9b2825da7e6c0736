"""Evaluation in the bubbles (runtime/bubble_fill.py, runtime/step_evaluation.py): the placement is
a valid, deadlock-free schedule that keeps training's order; it costs nothing where the step idles
long enough and never more than evaluating after the step; an E computes exactly what evaluation
after the step computes and leaves training's arithmetic alone; a bad fill is refused in one line."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.actions import E, Action, validate_actions
from hetlaunch.runtime.bubble_fill import fill_bubbles
from hetlaunch.runtime.executor import StageExecutor
from hetlaunch.runtime.schedules import schedule_named, simulate
from hetlaunch.runtime.step_evaluation import StepEvaluation

CASES = list(itertools.product(("1f1b", "gpipe", "zb-h1"), (1, 2, 3, 5), (1, 4, 9), (0.0, 0.3, 4.0)))


@pytest.mark.parametrize("name,stages,microbatches,latency", CASES)
def test_the_fill_keeps_training_order_and_costs_at_most_evaluation_after_the_step(name, stages, microbatches,
                                                                                   latency):
    per_stage = schedule_named(name).actions(stages, microbatches)
    forward = [1.0 + 0.5 * (j % 2) for j in range(stages)]  # uneven stages
    lists, report = fill_bubbles(per_stage, 3, forward, [2 * f for f in forward], [0.2] * (stages - 1),
                                 [latency] * (stages - 1))
    for j, (filled, training) in enumerate(zip(lists, per_stage)):
        assert [a for a in filled if a.kind is not E] == training
        assert [a.microbatch for a in filled if a.kind is E] == [0, 1, 2]  # held-out order, each once
        validate_actions(filled, microbatches, j, num_eval=3)
    assert report.step_with_eval_s == simulate(lists, forward, [2 * f for f in forward], [0.2] * (stages - 1),
                                               [latency] * (stages - 1))  # deadlock-free, and what it reports
    assert report.step_s <= report.step_with_eval_s <= report.after_step_s + 1e-9
    assert 0.0 <= report.filled_s <= min(report.idle_s, report.eval_s) + 1e-9


def test_a_latency_bound_pipeline_evaluates_for_free():
    """Two stages, 1F1B, 5 units of latency each way: stage 0 keeps two micro-batches in flight and
    waits about 10 units for each gradient, room for the held-out forwards (1 unit each) and for
    stage 1's in its own wait. The step is as long with them as without."""
    per_stage = schedule_named("1f1b").actions(2, 4)
    lists, report = fill_bubbles(per_stage, 4, [1.0, 1.0], [2.0, 2.0], [0.0], [5.0])
    assert report.step_with_eval_s == report.step_s
    assert report.filled_s == report.eval_s == 8.0
    assert report.after_step_s == report.step_s + 1 + 5 + 1 + 3 * 1  # down the pipeline, then one per unit
    assert lists[0].index(Action(0, E, 3)) < len(lists[0]) - 1  # inside the step, not after it


def _stage(dropout: bool = False) -> StageExecutor:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)] + ([nn.Dropout(0.5)] if dropout else [])
    return StageExecutor(layers, lambda out, y: (out - y).pow(2).mean(), is_first=True, is_last=True,
                         device=torch.device("cpu"))


def _batches(seed: int, count: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)) for _ in range(count)]


ACTIONS = schedule_named("1f1b").stage_actions(0, 1, 3)
WITH_E = [Action(0, E, 0)] + ACTIONS[:2] + [Action(0, E, 1)] + ACTIONS[2:]


def test_an_e_computes_evaluation_after_the_step_and_leaves_training_alone():
    """Step 0, then step 1 with E's: the E's loss is the held-out loss of the weights after step 0,
    as `evaluate` after step 0 gives it; step 1's loss and the weights after it are bit for bit
    those of a run without E's."""
    plain, filled = _stage(), _stage()
    held_out = _batches(9, 2)
    for stage in (plain, filled):
        stage.train_step(ACTIONS, _batches(1), 3)
    after_step_0 = plain.evaluate(held_out, 2)
    second = plain.train_step(ACTIONS, _batches(2), 3)
    second_filled = filled.train_step(WITH_E, _batches(2), 3, eval_microbatches=held_out)
    assert second_filled.eval_loss == after_step_0
    assert second.eval_loss is None
    assert second_filled.loss == second.loss
    for p, q in zip(plain.module.parameters(), filled.module.parameters()):
        assert torch.equal(p, q)


def test_an_e_puts_the_random_state_back():
    """Dropout draws from the RNG in train mode: a step with E's draws training's masks exactly as
    one without, and leaves the RNG where that one leaves it."""
    plain, filled = _stage(dropout=True), _stage(dropout=True)
    torch.manual_seed(5)
    second = plain.train_step(ACTIONS, _batches(2), 3)
    after_plain = torch.get_rng_state()
    torch.manual_seed(5)
    second_filled = filled.train_step(WITH_E, _batches(2), 3, eval_microbatches=_batches(9, 2))
    assert torch.equal(torch.get_rng_state(), after_plain)
    assert second_filled.loss == second.loss
    for p, q in zip(plain.module.parameters(), filled.module.parameters()):
        assert torch.equal(p, q)


def _train_spec(**fields) -> pb.TrainSpec:
    base = dict(steps=4, num_microbatches=2, eval_every=2, eval_microbatches=2, micro_batch_size=1)
    return pb.TrainSpec(**{**base, **fields})


def test_a_bad_fill_is_refused_in_one_line():
    actions = schedule_named("1f1b").stage_actions(0, 2, 2)
    cases = {"F0 F1 B0 B1": "does not hold this step's schedule and one evaluation of each",
             "F0 E0 F1 B0 B1": "does not hold this step's schedule and one evaluation of each",
             "F0 E1 E0 F1 B0 B1": "does not hold this step's schedule",  # out of held-out order
             "F0 E0 E0 F1 B0 B1": "evaluated twice",
             "F0 E0 E1 F1 B1 B0": "does not hold this step's schedule",
             "F0 X1": "cannot read actions"}
    for text, message in cases.items():
        with pytest.raises(ValueError, match=f"stage 0's evaluation fill is not a schedule|{message}") as err:
            StepEvaluation(_train_spec(), pb.StageSpec(stage_index=0, num_stages=2, eval_fill=text), _stage(),
                           None, actions)
        assert message in str(err.value) and "\n" not in str(err.value), (text, err.value)


def _run_steps(evaluation: StepEvaluation, stage: StageExecutor, steps: range) -> list[pb.StepMetrics]:
    sent: list[pb.StepMetrics] = []
    evaluation.before_first_step(sent.append)
    for step in steps:
        actions, held_out = evaluation.step_actions()
        result = stage.train_step(actions, _batches(step), 3, eval_microbatches=held_out)
        evaluation.after_step(step + 1, result.eval_loss, pb.StepMetrics(step=step, has_loss=True, loss=result.loss),
                              sent.append)
    return sent


def test_the_last_stage_reports_a_step_at_once_and_its_held_out_loss_in_a_report_of_its_own():
    """A failure in step n + 1 must not take step n's report with it (a held report once did):
    step n goes out at once, marked eval_follows, and step n + 1's E's loss goes out for step n
    as eval_only before step n + 1's own report. After a restore at step 2 that asks for step 1's
    held-out loss again (eval_before_start), the first step measures it in its bubbles."""
    held_out = _batches(9, 2)
    fill = " ".join(a.label for a in WITH_E)
    spec = pb.StageSpec(stage_index=0, num_stages=1, eval_fill=fill)
    train = _train_spec(steps=3, num_microbatches=3, eval_every=1)
    plain, stage = _stage(), _stage()
    expected = []
    for step in range(3):
        plain.train_step(ACTIONS, _batches(step), 3)
        expected.append(plain.evaluate(held_out, 2))
    evaluation = StepEvaluation(train, spec, stage, None, ACTIONS)
    evaluation.held_out = held_out
    sent = _run_steps(evaluation, stage, range(3))
    assert [(m.step, m.eval_only, m.eval_follows, m.has_eval_loss) for m in sent] == [
        (0, False, True, False), (0, True, False, True), (1, False, True, False), (1, True, False, True),
        (2, False, False, True)]  # the last step's loss is measured after it: nothing follows it
    assert [m.eval_loss for m in sent if m.has_eval_loss] == expected

    restored = _stage()
    for step in range(2):
        restored.train_step(ACTIONS, _batches(step), 3)
    again = StepEvaluation(_train_spec(steps=3, num_microbatches=3, eval_every=1, start_step=2, eval_before_start=True),
                           spec, restored, None, ACTIONS)
    again.held_out = held_out
    sent = _run_steps(again, restored, range(2, 3))
    assert [(m.step, m.eval_only, m.eval_loss) for m in sent] == [(1, True, expected[1]), (2, False, expected[2])]


def _two_stages(rank: int, out_dir: str) -> None:
    """Stage 1 reaches E0 first thing, long before stage 0 sends it (stage 0 evaluates after its
    backwards, which wait for stage 1's): an E that waited for its input there would deadlock the
    step. The executor keeps it for later and the step ends with the loss `evaluate` gives."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from hetlaunch.runtime.codecs import codec_by_name
    from hetlaunch.runtime.link import Link

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()]
    cpu, none = torch.device("cpu"), codec_by_name("none")
    mine = layers[:2] if rank == 0 else layers[2:]
    peer = 1 - rank
    links = {"prev_link" if rank else "next_link": Link(peer, none, cpu, cpu),
             "eval_links": (Link(peer, none, cpu, cpu, tag=1), None) if rank else (None, Link(peer, none, cpu, cpu, tag=1))}
    stage = StageExecutor(mine, lambda out, y: (out - y).pow(2).mean(), is_first=rank == 0, is_last=rank == 1,
                          device=cpu, **links)
    actions = schedule_named("1f1b").stage_actions(rank, 2, 2)
    filled = actions + [Action(0, E, 0), Action(0, E, 1)] if rank == 0 else \
        [Action(1, E, 0)] + actions + [Action(1, E, 1)]
    batches, held_out = _batches(1, 2), _batches(9, 2)
    result = stage.train_step(filled, batches, 2, eval_microbatches=held_out)
    dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"loss": result.loss, "eval_loss": result.eval_loss}))


@pytest.mark.timeout(120)
def test_an_e_whose_input_has_not_come_waits_for_later_instead_of_deadlocking(tmp_path):
    import json

    from conftest import run_gloo_ranks

    run_gloo_ranks(_two_stages, 2, tmp_path, timeout_s=90)
    got = json.loads((tmp_path / "rank1.json").read_text())
    torch.manual_seed(0)  # the same four layers, in one process: the loss of the weights before the step
    whole = StageExecutor([nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()],
                          lambda out, y: (out - y).pow(2).mean(), is_first=True, is_last=True,
                          device=torch.device("cpu"))
    assert got["eval_loss"] == pytest.approx(whole.evaluate(_batches(9, 2), 2), rel=1e-6)
    assert got["loss"] == pytest.approx(whole.train_step(schedule_named("1f1b").stage_actions(0, 1, 2),
                                                         _batches(1, 2), 2).loss, rel=1e-6)


def _emulated_wire(rank: int, out_dir: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    from hetlaunch.runtime import host_clock
    from hetlaunch.runtime.codecs import codec_by_name
    from hetlaunch.runtime.emulation import WireEmulation
    from hetlaunch.runtime.link import Link

    cpu = torch.device("cpu")
    link = Link(1 - rank, codec_by_name("none"), cpu, cpu, emulation=WireEmulation.from_spec(0, 300.0), tag=1)
    if rank == 0:
        sent_at = host_clock.now()
        link.send(torch.arange(4.0))
        link.drain()
        dist.barrier()
        Path(out_dir, "sent.json").write_text(json.dumps(sent_at))
        return
    polls = []
    while not link.ready():
        polls.append(host_clock.now())
    seen_ready = host_clock.now()
    message = link.recv()
    dist.barrier()
    Path(out_dir, "got.json").write_text(json.dumps({"ready_at": seen_ready, "received_at": host_clock.now(),
                                                     "message": message.tolist(), "polls": len(polls),
                                                     "wire_free_at": link.emulation._wire_free_at}))


@pytest.mark.timeout(120)
def test_ready_says_a_message_is_here_only_once_its_emulated_latency_has_passed(tmp_path):
    """300 ms of emulated latency: `ready` is never true before the message is due, and `recv`
    after it returns that message without counting it on the wire a second time."""
    import json

    from conftest import run_gloo_ranks

    run_gloo_ranks(_emulated_wire, 2, tmp_path, timeout_s=90)
    sent_at = json.loads((tmp_path / "sent.json").read_text())
    got = json.loads((tmp_path / "got.json").read_text())
    assert got["message"] == [0.0, 1.0, 2.0, 3.0]
    assert got["ready_at"] >= sent_at + 0.3 - 0.01  # the header carries the send time, a few µs after sent_at
    assert got["polls"] > 0  # it said "not yet" at least once (300 ms is long)
    assert got["wire_free_at"] < sent_at + 0.05  # counted once: free from when it left (no bandwidth limit)
