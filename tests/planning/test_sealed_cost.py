"""The planner prices data_plane.encrypt: each node's measured cipher on the boundaries it seals,
and a sealed sync group as the sealed all-gather the runtime runs (never hierarchical)."""

from __future__ import annotations

import pytest
from plan_reference import regions_profile

from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.planner import price_pipelines
from hetlaunch.launcher.planning.profile_file import with_encryption
from hetlaunch.launcher.planning.sync_cost import allreduce_s, sealed_gather_s
from hetlaunch.runtime.node_measurement import cipher_seconds_per_byte

MiB = 2**20
CIPHER = 1e-9  # seal + open: 1 GB/s


def _profile(per_region: int = 1):
    profile = regions_profile(per_region=per_region, num_layers=4, param_bytes=4 * MiB, output_bytes=2 * MiB,
                              cross_bandwidth=1.25e8, cross_latency=0.02)
    nodes = [n.model_copy(update={"cipher_seconds_per_byte": CIPHER}) for n in profile.nodes]
    return profile.model_copy(update={"nodes": nodes})


def test_a_sealed_boundary_costs_its_senders_cipher_on_both_directions_wire_bytes():
    profile = _profile()
    a, b = profile.nodes  # a in region a, b in region b
    policy = CompressionConfig(intra_region="none", cross_region="int8", sync="none")
    clear = CostModel(profile, 4, compression=policy).evaluate([a, b], [(0, 2), (2, 4)], ["int8"])
    for mode, extra in (("off", 0.0), ("all", 1.0), ("cross_region", 1.0)):
        sealed = CostModel(with_encryption(profile, mode), 4, compression=policy).evaluate([a, b], [(0, 2), (2, 4)],
                                                                                           ["int8"])
        # int8 forward (a quarter of the bytes plus scales) and int8 backward, each sealed once and opened once
        cm = CostModel(profile, 4, compression=policy)
        wire = 2 * MiB * (cm._ratio["int8"] + cm._ratio[policy.gradient_codec("int8")])
        assert sealed.stages[0].compute_s - clear.stages[0].compute_s == pytest.approx(extra * wire * CIPHER)
        assert sealed.stages[1].compute_s == clear.stages[1].compute_s  # the last stage sends nothing forward
    inside = _profile(per_region=2)
    a0, a1 = inside.nodes[:2]  # both in region a: cross_region seals nothing, all seals it
    for mode, sealed in (("cross_region", False), ("all", True)):
        cm = CostModel(with_encryption(inside, mode), 4)
        assert cm.seals(a0, a1) is sealed
        assert (cm.codec_s(a0, 1, "none", a1) > 0) is sealed


def test_a_sealed_sync_group_is_priced_as_the_sealed_all_gather_and_never_by_region():
    profile = _profile(per_region=2)
    chains = [([n.name], [(0, 4)], 2) for n in profile.nodes]  # four one-stage pipelines, two per region
    clear = price_pipelines(profile, chains, compression=CompressionConfig(sync="none"))
    sealed = price_pipelines(with_encryption(profile, "cross_region"), chains, compression=CompressionConfig(sync="none"))
    (flat,), (gathered,) = clear.sync, sealed.sync
    assert flat.hierarchical and not gathered.hierarchical  # clear: by region; sealed: one all-gather
    num_bytes = 4 * 4 * MiB
    assert gathered.allreduce_s == pytest.approx(sealed_gather_s(num_bytes, 4, 1.25e8, 0.02, "none", 0.0, CIPHER))
    assert gathered.allreduce_s == pytest.approx(3 * (num_bytes / 1.25e8 + 0.02 + num_bytes * CIPHER))
    assert gathered.allreduce_s > allreduce_s(num_bytes, 4, 1.25e8, 0.02, "none")  # k-1 copies, not 2(k-1)/k
    assert sealed.step_s > clear.step_s


def test_a_node_measures_its_cipher():
    seconds = cipher_seconds_per_byte(1 * MiB, repeats=3)
    assert 0 < seconds < 1e-6  # somewhere between a GB/s and a MB/s on any machine that runs the suite
