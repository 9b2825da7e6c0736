"""Nodes that share a host share its cores: the planner prices that contention from the profile
(each node's host, its cores, the cores its stage keeps busy), and nowhere else."""

from __future__ import annotations

import pytest

import itertools
import random

from hetlaunch.launcher.planning.contention import _steady_stretches, host_factors, shared_core_stretch, shared_cores
from hetlaunch.launcher.planning.planner import plan, price_pipelines
from plan_reference import uniform_profile


def _on_hosts(profile, hosts: list[str | None], cores: int, cpu_per_wall: list[float]):
    return profile.model_copy(update={"nodes": [
        n.model_copy(update={"host": h, "host_cores": cores if h else None, "cpu_per_wall": c})
        for n, h, c in zip(profile.nodes, hosts, cpu_per_wall)]})


def test_two_busy_nodes_on_one_core_are_priced_about_twice_as_slow():
    alone = uniform_profile([1.0, 1.0], ["r", "r"])
    base = plan(alone, 8)
    shared = plan(_on_hosts(alone, ["h", "h"], 1, [1.0, 1.0]), 8)
    (host, factor), = shared.contention.items()
    # equal stages compute at once in the steady part of the step: both ask for their core
    assert host == "h" and factor == pytest.approx(2.0)
    assert shared.step_s == pytest.approx(base.step_s * factor, rel=0.05)
    assert [(s.layer_start, s.layer_end) for p in shared.pipelines for s in p.cost.stages] == \
        [(s.layer_start, s.layer_end) for p in base.pipelines for s in p.cost.stages]


def test_a_lightly_loaded_stage_asks_for_part_of_a_core():
    profile = uniform_profile([1.0, 1.0], ["r", "r"])
    profile = profile.model_copy(update={"nodes": [
        n.model_copy(update={"host": "h", "host_cores": 1, "cpu_per_wall": 1.0}) for n in profile.nodes]})
    result = plan(profile, 8)
    stages = [(s.compute_s, p.cost.num_microbatches) for p in result.pipelines for s in p.cost.stages]
    busiest = max(c * m for c, m in stages)
    assert result.contention["h"] == pytest.approx(sum(c * m / busiest for c, m in stages) / 1, rel=1e-3)


def test_enough_cores_or_a_node_alone_costs_nothing():
    alone = uniform_profile([1.0, 1.0], ["r", "r"])
    base = plan(alone, 8).step_s
    for hosts, cores, cpu in ((["h", "h"], 2, [1.0, 1.0]), (["h", "g"], 1, [1.0, 1.0]), (["h", "h"], 2, [0.3, 0.3]),
                              ([None, None], 1, [1.0, 1.0])):
        result = plan(_on_hosts(alone, hosts, cores, cpu), 8)
        assert result.contention == {} and result.step_s == pytest.approx(base, rel=1e-9), (hosts, cores, cpu)


def test_stages_that_mostly_wait_are_priced_for_the_moments_they_compute_at_once():
    # two stages on one core, each computing 30% of the time: the busiest shares the core while
    # the other computes, which the sum of their asks (0.6 of a core) would price as free
    alone = uniform_profile([1.0, 1.0], ["r", "r"])
    base = plan(alone, 8)
    result = plan(_on_hosts(alone, ["h", "h"], 1, [0.3, 0.3]), 8)
    work = sorted(s.compute_s * p.cost.num_microbatches for p in base.pipelines for s in p.cost.stages)
    assert result.contention["h"] == pytest.approx(1 + 0.3 * work[0] / work[1], abs=1e-4)
    assert result.step_s == pytest.approx(base.step_s * result.contention["h"], rel=0.05)


def _brute_force(threads, others, cores):
    total = 0.0
    for asks in itertools.product((0, 1), repeat=len(others)):
        chance = 1.0
        for (_, p), x in zip(others, asks):
            chance *= p if x else 1 - p
        total += chance * max(1.0, (threads + sum(t for (t, _), x in zip(others, asks) if x)) / cores)
    return total


def test_shared_core_stretch_is_the_expected_share_of_the_cores():
    rng = random.Random(7)
    for _ in range(200):
        others = [(rng.choice([1.0, 1.0, 1.5, 2.0, 3.25]), rng.random()) for _ in range(rng.randint(0, 7))]
        threads, cores = rng.choice([1.0, 2.0, 2.5]), rng.randint(1, 8)
        # exact to a hundredth of a core up to 4 cores; beyond, totals are kept to a 400th of the cores
        assert shared_core_stretch(threads, others, cores) == pytest.approx(_brute_force(threads, others, cores),
                                                                            rel=1e-9 if cores <= 4 else 2e-3), \
            (threads, others, cores)
    # every stage asking all the time: the cores asked for over the cores, as a sum prices it
    assert shared_core_stretch(1.0, [(1.0, 1.0)] * 3, 2) == pytest.approx(2.0)
    assert shared_core_stretch(1.8, [(1.8, 1.0)], 2) == pytest.approx(1.8)
    # four agents asking a quarter of a core each on 2 cores (bench/cost_model_error.py's emulated nodes)
    assert shared_core_stretch(1.0, [(1.0, 0.25)] * 3, 2) == pytest.approx(1 + 3 * 0.25**2 * 0.75 * 0.5 + 0.25**3)
    assert shared_core_stretch(1.0, [(1.0, 0.9)] * 7, 8) == pytest.approx(1.0, abs=1e-12)  # never more than the cores


def test_repricing_a_contended_plan_gives_the_same_step():
    profile = _on_hosts(uniform_profile([1.0, 0.5, 1.0], ["r", "r", "r"]), ["h", "h", "h"], 2, [1.0, 0.5, 1.0])
    planned = plan(profile, 8)
    cuts = [(s.node, s.layer_start, s.layer_end) for s in planned.pipelines[0].cost.stages]
    again = price_pipelines(profile, [([n for n, _, _ in cuts], [(a, b) for _, a, b in cuts], 8)])
    assert again.contention == planned.contention and again.step_s == pytest.approx(planned.step_s, rel=1e-6)
    assert host_factors(profile, []) == {}


def _on_host(cpus: list[float], cores: int):
    return _on_hosts(uniform_profile([1.0] * len(cpus), ["r"] * len(cpus)), ["h"] * len(cpus), cores, cpus)


def test_the_price_follows_the_nodes_and_not_their_order():
    # a stage that mostly waits (cpu 0.1) beside one asking its whole core: it is the one stretched most
    for cpus, cores in (([1.0, 0.1], 1), ([1.0, 1.0, 0.25, 0.25], 2)):
        forward = plan(_on_host(cpus, cores), 8)
        backward = plan(_on_host(cpus[::-1], cores), 8)
        assert forward.contention == backward.contention and forward.contention["h"] > 1.01
        profile = _on_host(cpus, cores)
        stretch = shared_cores(profile, [p.cost for p in forward.pipelines])[1]
        waiting = [n.name for n in profile.nodes if n.cpu_per_wall < 1]
        busy = [n.name for n in profile.nodes if n.cpu_per_wall == 1]
        assert min(stretch[n] for n in waiting) > max(stretch[n] for n in busy)


def test_a_slower_stage_never_shortens_the_hosts_steady_part():
    rng = random.Random(3)
    for _ in range(300):
        n, cores = rng.randint(2, 6), rng.randint(1, 4)
        stages = [(rng.uniform(0.2, 1.0), rng.choice([1.0, 1.0, 0.5, 0.25, 0.1, 2.0])) for _ in range(n)]
        k = rng.randrange(n)
        slower = [(w * 1.03 if j == k else w, cpu) for j, (w, cpu) in enumerate(stages)]
        periods = []
        for case in (stages, slower):
            top = max(w for w, _ in case)
            stretch = _steady_stretches([(w / top, cpu) for w, cpu in case], cores)
            periods.append(max(w * s for (w, _), s in zip(case, stretch)))
        assert periods[1] >= periods[0] * (1 - 1e-6), (stages, k, cores, periods)
