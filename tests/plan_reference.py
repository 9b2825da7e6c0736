"""References for the planner, written apart from it: an event simulation of a plan's pipelines
by another algorithm than runtime/schedules.py's, small random profiles, and a brute force
over every chain, cut and 1F1B window vector a small cluster admits.

The simulation walks each action's dependencies recursively (longest path through the step's
graph) instead of sweeping stages: an action starts when its stage is free and its input has
arrived; a message leaves when its action ends and the one sent before it on the same wire has
left (a wire carries one message at a time per direction), and arrives one latency later.
"""

from __future__ import annotations

import itertools
import math
import random
import sys

from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile
from hetlaunch.runtime.registry import STATIC_BYTES_PER_PARAM_BYTE
from hetlaunch.runtime.schedules import compiled, schedule_for, simulate_compiled

GiB, MiB = 2**30, 2**20


def reference_step(schedule: str, stages: list[dict], num_microbatches: int) -> float:
    """The step of one pipeline from its JSON stages (`hetlaunch plan --json`): forward_s,
    backward_s, optimizer_s, link_s, latency_s and window each, and for a split backward (ZB)
    input_grad_s and weight_grad_s: an I sends the gradient upstream as a B does, a W follows its
    I; where some stage measured neither, each of I and W costs half a backward."""
    S, M = len(stages), num_microbatches
    measured = all(s.get("input_grad_s", 0.0) + s.get("weight_grad_s", 0.0) > 0 for s in stages)
    lists = [[(a.kind.value, a.microbatch) for a in schedule_for(schedule, j, S, M, s["window"])]
             for j, s in enumerate(stages)]
    position = [{action: i for i, action in enumerate(actions)} for actions in lists]
    ends: dict[tuple[int, int], float] = {}
    leaves: dict[tuple[int, str, int], float] = {}  # (stage, op, micro-batch) -> when its message left the stage
    visiting: set = set()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20 * S * M + 1000))

    def cost(j: int, op: str) -> float:
        if op in ("F", "B"):
            return stages[j]["forward_s" if op == "F" else "backward_s"]
        if measured:
            return stages[j]["input_grad_s" if op == "I" else "weight_grad_s"]
        return stages[j]["backward_s"] / 2

    def direction(op: str) -> str:
        """The wire a message takes: forwards down, gradients (a B's or an I's) up; W sends nothing."""
        return "down" if op == "F" else "up"

    def gradient(j: int, m: int) -> str:
        """Which action of stage j sends micro-batch m's gradient upstream."""
        return "I" if ("I", m) in position[j] else "B"

    def end(j: int, i: int) -> float:
        if (j, i) in ends:
            return ends[(j, i)]
        if (j, i) in visiting:
            raise ValueError(f"deadlock at stage {j} action {lists[j][i]}")
        visiting.add((j, i))
        op, m = lists[j][i]
        start = end(j, i - 1) if i else 0.0
        if op == "F" and j > 0:
            start = max(start, arrival(j - 1, "F", m, j - 1))
        if op in ("B", "I"):
            start = max(start, end(j, position[j][("F", m)]))
            if j < S - 1:
                start = max(start, arrival(j + 1, gradient(j + 1, m), m, j))
        if op == "W":
            start = max(start, end(j, position[j][("I", m)]))
        visiting.discard((j, i))
        ends[(j, i)] = start + cost(j, op)
        return ends[(j, i)]

    def left(j: int, op: str, m: int, wire: int) -> float:
        """When the message of stage j's action (op, m) finished crossing wire `wire`."""
        key = (j, op, m)
        if key not in leaves:
            i = position[j][(op, m)]
            previous = [k for k in range(i) if lists[j][k][0] != "W" and direction(lists[j][k][0]) == direction(op)]
            queue = left(j, op, lists[j][previous[-1]][1], wire) if previous else 0.0
            leaves[key] = max(end(j, i), queue) + stages[wire]["link_s"]
        return leaves[key]

    def arrival(j: int, op: str, m: int, wire: int) -> float:
        return left(j, op, m, wire) + stages[wire]["latency_s"]

    return max(end(j, len(lists[j]) - 1) + stages[j]["optimizer_s"] for j in range(S))


def random_profile(rng: random.Random, num_nodes: int, num_regions: int, num_layers: int,
                   memory_gb: tuple[float, float] = (1.0, 4.0), slow_links: bool = True) -> Profile:
    """Nodes of a few speeds in a few regions; fast links inside a region, slower and distant ones
    between regions (or fast ones everywhere with slow_links False)."""
    regions = [f"r{i}" for i in range(num_regions)]
    layers = [LayerInfo(param_bytes=rng.randint(1, 50) * MiB, activation_bytes=rng.randint(1, 40) * MiB,
                        output_bytes=rng.randint(1, 8) * MiB) for _ in range(num_layers)]
    base = [rng.uniform(0.002, 0.02) for _ in range(num_layers)]
    nodes = []
    for i in range(num_nodes):
        speed = rng.choice([1.0, 1.0, 0.5, 0.25, 2.0])
        nodes.append(NodeProfile(name=f"n{i}", region=regions[i % num_regions] if i < num_regions else rng.choice(regions),
                                 device="dev", memory_bytes=rng.uniform(*memory_gb) * GiB,
                                 layer_seconds=[b / speed for b in base],
                                 optimizer_seconds=[rng.uniform(0, 0.002) for _ in base]))
    links = []
    for a, b in itertools.combinations_with_replacement(regions, 2):
        fast = a == b or not slow_links
        links.append(LinkProfile(regions=(a, b),
                                 bandwidth_bytes_per_s=rng.uniform(5e9, 2e10) if fast else rng.uniform(5e7, 1e9),
                                 latency_s=rng.uniform(1e-5, 1e-4) if fast else rng.uniform(0.005, 0.05)))
    return Profile(model=ModelIdentity(description="synthetic", num_layers=num_layers), micro_batch_size=4,
                   seq_len=128, layers=layers, nodes=nodes, links=links)


def uniform_profile(speeds: list[float], regions: list[str], num_layers: int = 8, memory_gb: float = 8.0,
                    cross_bandwidth: float = 1e7, cross_latency: float = 0.02, param_bytes: int = 2**20) -> Profile:
    layers = [LayerInfo(param_bytes=param_bytes, activation_bytes=2**20, output_bytes=2**20) for _ in range(num_layers)]
    nodes = [NodeProfile(name=f"n{i}", region=r, device="dev", memory_bytes=memory_gb * GiB,
                         layer_seconds=[0.01 / s] * num_layers) for i, (s, r) in enumerate(zip(speeds, regions))]
    links = [LinkProfile(regions=(r, r), bandwidth_bytes_per_s=1e10, latency_s=1e-5) for r in sorted(set(regions))]
    for a, b in itertools.combinations(sorted(set(regions)), 2):
        links.append(LinkProfile(regions=(a, b), bandwidth_bytes_per_s=cross_bandwidth, latency_s=cross_latency))
    return Profile(model=ModelIdentity(description="uniform", num_layers=num_layers), micro_batch_size=4,
                   seq_len=64, layers=layers, nodes=nodes, links=links)


def _link(profile: Profile, a: NodeProfile, b: NodeProfile) -> tuple[float, float]:
    for link in profile.links:
        if link.nodes is None and sorted(link.regions) == sorted((a.region, b.region)):
            return link.bandwidth_bytes_per_s, link.latency_s
    raise AssertionError(f"no link {a.region} - {b.region}")


def _window_vectors(S: int, M: int, caps: list[int]):
    """Every vector the executor runs without deadlock: own_j <= w_j <= caps_j, never growing down
    the pipeline, the last stage at its own."""
    own = [min(S - j, M) for j in range(S)]
    ranges = [range(own[j], max(own[j], caps[j]) + 1) if j < S - 1 else range(own[j], own[j] + 1) for j in range(S)]
    for vector in itertools.product(*ranges):
        if all(a >= b for a, b in zip(vector, vector[1:])):
            yield vector, own


def brute_force(profile: Profile, M: int, schedule: str = "1f1b") -> float:
    """The fastest pipeline (codecs none) over every ordered subset of nodes, every cut and, under
    1F1B, every admissible window vector that fits memory, each priced by simulation."""
    L, layers = profile.model.num_layers, profile.layers
    best = math.inf
    for k in range(1, min(len(profile.nodes), L) + 1):
        for chain in itertools.permutations(profile.nodes, k):
            links = [_link(profile, a, b) for a, b in zip(chain, chain[1:])]
            for bounds in itertools.combinations(range(1, L), k - 1):
                edges = (0, *bounds, L)
                cuts = list(zip(edges, edges[1:]))
                compute = [sum(n.layer_seconds[a:b]) for n, (a, b) in zip(chain, cuts)]
                optimizer = [sum(n.optimizer_seconds[a:b]) for n, (a, b) in zip(chain, cuts)]
                if max(M * t + o / 1 for t, o in zip(compute, optimizer)) >= best:
                    continue  # no schedule beats one stage computing every micro-batch
                static = [STATIC_BYTES_PER_PARAM_BYTE * sum(x.param_bytes for x in layers[a:b]) for a, b in cuts]
                per_mb = [sum(x.activation_bytes for x in layers[a:b]) for a, b in cuts]
                caps = [min(M, int((n.memory_bytes - s) // p)) for n, s, p in zip(chain, static, per_mb)]
                wire = [layers[b - 1].output_bytes / bw for (_, b), (bw, _) in zip(cuts, links)]
                latency = [lat for _, lat in links]
                if schedule == "gpipe":  # every stage holds every micro-batch; no window to choose
                    caps = [M if c >= M else 0 for c in caps]
                for windows, own in _window_vectors(k, M, caps) if schedule == "1f1b" else [((M,) * k, [M] * k)]:
                    if any(w > c for w, c in zip(windows, caps)):
                        continue  # even the stage's own window does not fit
                    plan = compiled([schedule_for(schedule, j, k, M, w if w > own[j] else 0)
                                     for j, w in enumerate(windows)])
                    best = min(best, simulate_compiled(plan, [t / 3 for t in compute], [2 * t / 3 for t in compute],
                                                       wire, latency, optimizer))
    return best


def regions_profile(per_region: int = 2, regions: tuple[str, ...] = ("a", "b"), num_layers: int = 8,
                    layer_s: float = 0.05, param_bytes: int = 64 * 2**10, output_bytes: int = 8 * 2**20,
                    cross_bandwidth: float = 1.25e6, cross_latency: float = 0.05,
                    codec_seconds_per_byte: dict[str, float] | None = None) -> Profile:
    """Equal nodes, `per_region` in each region; fast links inside a region, one kind across."""
    layers = [LayerInfo(param_bytes=param_bytes, activation_bytes=output_bytes, output_bytes=output_bytes)
              for _ in range(num_layers)]
    nodes = [NodeProfile(name=f"{r}{i}", region=r, device="dev", memory_bytes=80 * 2**30,
                         layer_seconds=[layer_s] * num_layers, optimizer_seconds=[layer_s / 10] * num_layers,
                         codec_seconds_per_byte=codec_seconds_per_byte)
             for r in regions for i in range(per_region)]
    links = [LinkProfile(regions=(r, r), bandwidth_bytes_per_s=1e10, latency_s=1e-5) for r in regions]
    links += [LinkProfile(regions=(a, b), bandwidth_bytes_per_s=cross_bandwidth, latency_s=cross_latency)
              for a, b in itertools.combinations(regions, 2)]
    return Profile(model=ModelIdentity(description="m", num_layers=num_layers), micro_batch_size=4, seq_len=64,
                   layers=layers, nodes=nodes, links=links)


def prefix_sums(values: list[float]) -> list[float]:
    acc = [0.0]
    for v in values:
        acc.append(acc[-1] + v)
    return acc


def random_chain_prefixes(rng: random.Random, coarse: bool, max_layers: int = 24):
    """Per stage of a random chain: time and memory prefix sums over L layers and a memory capacity
    (an int, as a profile's), with layer times drawn from four values when `coarse` (many exact
    ties, so that limits land exactly on prefix sums). (L, S, times, memory, capacities)."""
    L, S = rng.randint(1, max_layers), rng.randint(1, 8)
    value = (lambda: rng.choice([0.25, 0.5, 1.0, 2.0])) if coarse else (lambda: rng.uniform(0.01, 2.0))
    times = [prefix_sums([value() for _ in range(L)]) for _ in range(S)]
    memory = [prefix_sums([value() * 1e9 for _ in range(L)]) for _ in range(S)]
    capacities = [rng.choice([rng.randint(10**9, 3 * 10**10), 10**12]) for _ in range(S)]
    return L, S, times, memory, capacities


def random_floor_args(rng: random.Random, coarse: bool, max_layers: int = 24) -> tuple:
    """Arguments of the floor program (launcher/planning/chain_bounds.py floors_program_python) for a
    random chain, with a limit around where its answer turns: M times the average stage, give or take."""
    L, S, times, memory, capacities = random_chain_prefixes(rng, coarse, max_layers)
    optimizer = prefix_sums([rng.choice([0.0, 0.01, rng.uniform(0, 0.1)]) for _ in range(L)])
    hops = [rng.choice([0.0, 0.25, rng.uniform(0, 1)]) for _ in range(S - 1)]
    M = rng.choice([1, 4, 8, 64])
    g, h = rng.choice([(2 / 3, 1.0), (0.0, 0.0)])
    limit = M * sum(t[-1] for t in times) / S / S * rng.choice([0.5, 1.0, 1.5, 3.0, 10.0])
    return times, memory, capacities, optimizer, hops, M, limit, g, h


def random_suffix(rng: random.Random, coarse: bool) -> tuple:
    """launcher/planning/_cutfront.c suffix_fronts' arguments at random: prefix sums of compute,
    static and activation bytes, a memory that cuts some ranges off, windows own or deepest, and
    following fronts that are fronts (sums falling) or not (arbitrary points, which the compiled
    rows must sort rather than prune). three_term_fronts takes the same but `deepens` (index 7).
    `coarse` draws from a few values, so that many points tie."""
    value = (lambda: rng.choice([0.0, 0.25, 0.5, 1.0])) if coarse else (lambda: rng.uniform(0.0, 1.0))
    L = rng.randint(2, 12)

    def prefix(scale: float) -> list[float]:
        acc = [0.0]
        for _ in range(L):
            acc.append(acc[-1] + (rng.choice([0.0, scale, 2 * scale]) if coarse else rng.uniform(0, scale)))
        return acc
    crossings = [[None] + [(value(), value(), value(), codec) for _ in range(L)]
                 for codec in rng.sample(["none", "int8", "topk"], rng.randint(1, 3))]
    following = [None]
    for end in range(1, L + 1):
        points = sorted(((value(), value(), value(), value(), end, k - 1, "none") for k in range(rng.randint(0, 8))),
                        key=lambda p: (max(p[:3]), p[3]))
        if rng.random() < 0.7:  # a front: each point's sum below every earlier one's
            points = [p for k, p in enumerate(points) if all(p[3] < q[3] for q in points[:k])]
        following.append(points)
    last_end = rng.randint(1, L)
    starts = sorted(rng.sample(range(0, last_end), rng.randint(1, last_end)))
    return (starts, prefix(1.0), prefix(10.0), prefix(5.0), rng.uniform(0, 60), rng.randint(1, 4), rng.randint(1, 40),
            rng.random() < 0.5, crossings, following, last_end)
