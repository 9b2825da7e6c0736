"""The long chain's bottleneck bisection (launcher/planning/_bottleneck.c) and the floor program
(launcher/planning/_floors.c) are their Python loops, faster: the same cuts and the same answers on
random inputs, including inputs drawn from few values so that limits land exactly on prefix sums;
bad input refused; and whole plans of a large cluster made with either are the same plans."""

from __future__ import annotations

import math
import random

import pytest

from hetlaunch.launcher.planning import bottleneck_fill, chain_bounds, chain_cuts, chain_search
from hetlaunch.launcher.planning.bottleneck_fill import bottleneck_bisect_python
from hetlaunch.launcher.planning.chain_bounds import floors_program_python
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.planner import plan
from plan_reference import random_chain_prefixes, random_floor_args


def test_the_compiled_loops_are_built():
    # pip install -e . builds them wherever a C compiler is found (setup.py); CI must test them, not skip them
    assert bottleneck_fill.COMPILED, "launcher/planning/_bottleneck.c was not built: install a C compiler"
    assert chain_bounds.COMPILED, "launcher/planning/_floors.c was not built: install a C compiler"


needs_core = pytest.mark.skipif(not (bottleneck_fill.COMPILED and chain_bounds.COMPILED),
                                reason="not built: see test_the_compiled_loops_are_built")


@needs_core
def test_the_compiled_bisection_gives_the_python_cuts():
    rng, cut = random.Random(3), 0
    for case in range(3000):
        L, S, times, memory, capacities = random_chain_prefixes(rng, coarse=case % 2 == 0)
        outputs = [rng.choice([1, 2**20, 3 * 2**20]) for _ in range(L)]
        links = [rng.choice([0.0, 1e-9, rng.uniform(0, 1e-6)]) for _ in range(S - 1)] + [0.0]
        stages = [(times[j], memory[j], capacities[j], L - (S - 1 - j), links[j]) for j in range(S)]
        hi = max(t[-1] for t in times) + rng.choice([0.0, 0.5])
        args = (stages, outputs, 0.0, hi, rng.choice([0, 1, 20]))
        want = bottleneck_bisect_python(*args)
        assert bottleneck_fill._bottleneck.bottleneck_bisect(*args) == want, args
        cut += want is not None
    assert 1000 < cut < 2900  # both outcomes are exercised


@needs_core
def test_the_compiled_floor_program_gives_the_python_answer():
    rng, yes = random.Random(4), 0
    for case in range(3000):
        args = random_floor_args(rng, coarse=case % 2 == 0)
        want = floors_program_python(*args)
        assert chain_bounds._floors.floors_under(*args) is want, args
        yes += want
    assert 300 < yes < 2700  # both answers are exercised


@needs_core
def test_bad_input_is_refused_not_read_past():
    bisect_core, floors_core = bottleneck_fill._bottleneck.bottleneck_bisect, chain_bounds._floors.floors_under
    prefix = [0.0, 1.0, 2.0]
    with pytest.raises(TypeError):  # a time prefix one short of the layers
        bisect_core([([0.0, 1.0], prefix, 10, 2, 0.0)], [1, 1], 0.0, 5.0, 5)
    with pytest.raises(TypeError):  # a stage without its link
        bisect_core([(prefix, prefix, 10, 2)], [1, 1], 0.0, 5.0, 5)
    with pytest.raises(TypeError):
        bisect_core([(prefix, ["a", 1.0, 2.0], 10, 2, 0.0)], [1, 1], 0.0, 5.0, 5)
    with pytest.raises(TypeError):
        bisect_core([], [1, 1], 0.0, 5.0, 5)
    with pytest.raises(TypeError):  # memory for one stage of two
        floors_core([prefix, prefix], [prefix], [10, 10], prefix, [0.0], 4, 10.0, 0.0, 0.0)
    with pytest.raises(TypeError):  # a hop too few
        floors_core([prefix, prefix], [prefix, prefix], [10, 10], prefix, [], 4, 10.0, 0.0, 0.0)

    class Number:
        def __float__(self):
            prefix.extend([3.0] * 1000)
            return 0.5
    with pytest.raises(TypeError):  # refused before any Python code runs, not read past its end
        floors_core([[0.0, Number(), 2.0]], [prefix], [10], prefix, [], 4, 10.0, 0.0, 0.0)
    assert len(prefix) == 3
    assert bisect_core([(prefix, prefix, 10, 2, 0.0)], [1, 1], 0.0, 5.0, 20) == \
        bottleneck_bisect_python([(prefix, prefix, 10, 2, 0.0)], [1, 1], 0.0, 5.0, 20) == [(0, 2)]
    assert floors_core([prefix], [prefix], [10], prefix, [], 4, 10.0, 0.0, 0.0) is True
    assert floors_core([prefix], [prefix], [10], prefix, [], 4, 8.0 - 1e-9, 0.0, 0.0) is False
    assert floors_core([prefix], [prefix], [1], prefix, [], 4, math.inf, 0.0, 0.0) is False  # memory


@needs_core
@pytest.mark.parametrize("compression", [CompressionConfig(), NONE], ids=["auto", "none"])
def test_plans_made_with_the_python_loops_are_the_plans_made_with_the_compiled_ones(monkeypatch, compression):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from planning_time import synthetic_profile  # 40 nodes, 4 regions: long chains cut by bisection

    profile = synthetic_profile(num_nodes=40, num_regions=4, num_layers=48, seed=1)

    def planned():
        result = plan(profile, num_microbatches=16, schedule="1f1b", max_pipelines=4, compression=compression)
        return result.tokens_per_s, [p.cost for p in result.pipelines]  # every stage's every field

    compiled = planned()
    assert max(len(cost.stages) for cost in compiled[1]) * 48 ** 2 > chain_cuts.EXACT_MAX_WORK  # bisected
    monkeypatch.setattr(chain_cuts, "bottleneck_bisect", bottleneck_bisect_python)
    monkeypatch.setattr(chain_bounds, "floors_program", floors_program_python)
    assert planned() == compiled
    assert chain_search.floors_under is chain_bounds.floors_under  # the patched name is the one searched with
