"""The cluster YAML schema: examples load, defaults hold, every bad input is one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, error_of
from hetlaunch.launcher.cluster_config import ClusterConfig
from hetlaunch.launcher.config_types import ConfigError
from hetlaunch.launcher.cluster_yaml import cluster_from_dict, load_cluster, parse_cluster
from hetlaunch.launcher.planning.plan import TilingError, check_layer_tiling
from hetlaunch.runtime.model_spec import PRESETS, ModelSpec

EXAMPLES = REPO / "cluster_examples"


# ------------------------------------------------------------------ examples


@pytest.mark.parametrize("name", ["local", "multi_host", "tiny_test", "islands", "hf_gpt2"])
def test_examples_load(name: str) -> None:
    cfg = load_cluster(EXAMPLES / f"{name}.yaml")
    assert isinstance(cfg, ClusterConfig)
    assert isinstance(cfg.model.to_spec(), ModelSpec)


def test_local_example_shape() -> None:
    cfg = load_cluster(EXAMPLES / "local.yaml")
    assert len(cfg.local_nodes) == 4 and cfg.remote_nodes == []
    regions = sorted({n.region for n in cfg.nodes})
    assert regions == ["eu-west", "us-east"]
    assert [sum(n.region == r for n in cfg.nodes) for r in regions] == [2, 2]
    link = cfg.link_between("eu-west", "us-east")
    assert link is not None and link.emulate.bandwidth_mbps > 0
    assert any(n.emulate.speed < 1 for n in cfg.nodes)
    assert all(n.threads == 1 for n in cfg.nodes)
    assert cfg.model.preset == "tiny"
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.train.num_microbatches) == (300, 8, 4)


def test_multi_host_example_shape() -> None:
    cfg = load_cluster(EXAMPLES / "multi_host.yaml")
    assert (cfg.coordinator.host, cfg.coordinator.port) == ("0.0.0.0", 29400)
    assert len(cfg.remote_nodes) == 3 and cfg.local_nodes == []
    assert all(n.host and n.device == "cuda" for n in cfg.nodes)
    assert len({n.region for n in cfg.nodes}) == 2


def test_tiny_test_example_shape() -> None:
    cfg = load_cluster(EXAMPLES / "tiny_test.yaml")
    gpt = cfg.model.to_spec().gpt
    assert (gpt.n_layers, gpt.seq_len, gpt.d_model) == (2, 32, 32)
    assert len(cfg.local_nodes) == 3 and all(n.threads == 1 for n in cfg.nodes)
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.train.num_microbatches) == (20, 4, 4)


# ------------------------------------------------------------------ defaults and helpers


def test_defaults() -> None:
    cfg = parse_cluster("nodes: [{name: a}]")
    assert cfg.name == "job"
    assert (cfg.coordinator.host, cfg.coordinator.port) == ("127.0.0.1", 0)
    assert (cfg.coordinator.join_timeout_s, cfg.coordinator.heartbeat_timeout_s) == (60, 4)
    assert cfg.coordinator.heartbeat_interval_s == 0.5
    assert cfg.model.preset == "tiny" and cfg.model.entrypoint is None and cfg.model.kwargs == {}
    assert cfg.model.to_spec() == ModelSpec(gpt=PRESETS["tiny"])
    assert (cfg.data.path, cfg.data.seed) == (None, 0)
    t = cfg.train
    assert (t.steps, t.micro_batch_size, t.num_microbatches, t.schedule) == (300, 8, 4, "auto")
    assert (t.lr, t.weight_decay, t.seed) == (3.0e-3, 0.0, 0)
    assert (t.checkpoint_every, t.max_restarts, cfg.checkpoint.dir, cfg.checkpoint.keep) == (50, 3, None, 2)
    assert cfg.regions == [] and cfg.links == []
    node = cfg.nodes[0]
    assert (node.region, node.launch, node.host, node.device) == ("default", "local", None, "auto")
    assert (node.threads, node.layers, node.emulate.speed, node.emulate.memory_gb) == (None, None, 1.0, None)


def test_empty_sections_mean_defaults() -> None:
    cfg = parse_cluster("model:\ntrain:\nlinks:\nnodes: [{name: a}]")
    assert cfg.model.preset == "tiny" and cfg.train.steps == 300 and cfg.links == []


def test_sizes_override_preset() -> None:
    gpt = parse_cluster("model: {preset: small, n_layers: 2, d_ff: 100}\nnodes: [{name: a}]").model.to_spec().gpt
    assert (gpt.n_layers, gpt.d_ff, gpt.d_model) == (2, 100, PRESETS["small"].d_model)


def test_entrypoint_model() -> None:
    cfg = parse_cluster("model: {entrypoint: 'pkg.mod:build', kwargs: {seq_len: 16, width: 8}}\n"
                        "nodes: [{name: a, layers: [0, 9]}, {name: b, layers: [9, 12]}]")
    assert cfg.model.preset is None and cfg.model.num_stage_layers is None
    assert cfg.model.to_spec() == ModelSpec(entrypoint="pkg.mod:build", kwargs={"seq_len": 16, "width": 8})


def test_scientific_float_without_dot() -> None:
    # PyYAML reads `3e-3` as a string; the schema takes it as the number meant.
    assert parse_cluster("train: {lr: 3e-3}\nnodes: [{name: a}]").train.lr == 3e-3


def test_node_helpers() -> None:
    cfg = parse_cluster("nodes:\n"
                        "  - {name: a, region: r1}\n"
                        "  - {name: b, region: r2, threads: 3}\n"
                        "  - {name: c, region: r2, launch: remote, host: h}\n"
                        "links: [{between: [r2, r1], emulate: {latency_ms: 0}}]")
    assert [n.name for n in cfg.local_nodes] == ["a", "b"] and [n.name for n in cfg.remote_nodes] == ["c"]
    assert cfg.link_between("r1", "r2") is cfg.link_between("r2", "r1") is cfg.links[0]
    assert cfg.link_between("r1", "r1") is None and cfg.link_between("r1", "nowhere") is None
    assert cfg.node("b").threads == 3
    assert cfg.threads_for(cfg.node("a"), cpu_count=8) == 4 and cfg.threads_for(cfg.node("b"), cpu_count=8) == 3
    assert cfg.threads_for(cfg.node("a"), cpu_count=1) == 1


def test_pinned_layers_that_tile() -> None:
    cfg = parse_cluster("nodes: [{name: a, layers: [2, 6]}, {name: b, layers: [0, 2]}]")
    assert [n.layers for n in cfg.nodes] == [(2, 6), (0, 2)]


# ------------------------------------------------------------------ file and YAML errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such file$"):
        load_cluster(tmp_path / "nope.yaml")


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_cluster(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"nodes: [{name: \xff}]\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_cluster(path)


def test_load_names_the_file_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("nodes: [{name: a, regoin: x}]\n")
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert str(info.value) == f"{path}: nodes[0].regoin: unknown key (did you mean 'region'?)"


def test_malformed_yaml() -> None:
    msg = error_of("nodes:\n  - name: a\n   region: x\n")
    assert msg.startswith("cluster.yaml: not valid YAML (line 3, column 4): ")


def test_two_documents() -> None:
    assert "not valid YAML (line 2, column 1)" in error_of("nodes: [{name: a}]\n---\nx: 1\n")


def test_empty_file() -> None:
    assert "file is empty" in error_of("")
    assert "file is empty" in error_of("# only a comment\n")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just text\n", "42\n"])
def test_top_level_not_a_mapping(text: str) -> None:
    assert "top level must be a mapping" in error_of(text)


def test_duplicate_key() -> None:
    assert error_of("train: {steps: 1, steps: 2}\nnodes: [{name: a}]") == \
        "cluster.yaml: train.steps: duplicate key (line 1, column 19)"


def test_cluster_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        cluster_from_dict(["nodes"])


# ------------------------------------------------------------------ schema errors


def test_unknown_key_names_the_path() -> None:
    msg = error_of("nodes: [{name: a}, {name: b}, {name: c, regoin: x}]")
    assert msg == "cluster.yaml: nodes[2].regoin: unknown key (did you mean 'region'?)"


def test_unknown_key_lists_valid_keys_when_nothing_is_close() -> None:
    assert error_of("nodes: [{name: a, emulate: {zzz: 1}}]").endswith(
        "nodes[0].emulate.zzz: unknown key (valid: speed, memory_gb, speed_changes)")
    assert "cluster.yaml: trian: unknown key (did you mean 'train'?)" == error_of("trian: {}\nnodes: [{name: a}]")


def test_bound_violation() -> None:
    assert error_of("train: {steps: 0}\nnodes: [{name: a}]") == "cluster.yaml: train.steps: must be >= 1 (got 0)"
    assert "train.lr: must be > 0 (got 0.0)" in error_of("train: {lr: 0.0}\nnodes: [{name: a}]")
    assert "coordinator.port: must be <= 65535 (got 70000)" in error_of("coordinator: {port: 70000}\nnodes: [{name: a}]")
    assert "nodes[0].emulate.speed: must be <= 1 (got 2)" in error_of("nodes: [{name: a, emulate: {speed: 2}}]")
    assert "nodes[0].emulate.memory_gb: must be >= 1e-09" in error_of("nodes: [{name: a, emulate: {memory_gb: 0}}]")
    assert "train.lr: must be <= 1000 (got inf)" in error_of("train: {lr: .inf}\nnodes: [{name: a}]")
    assert "train.lr: must be <= 1000 (got nan)" in error_of("train: {lr: .nan}\nnodes: [{name: a}]")


@pytest.mark.parametrize("text, said", [
    ("nodes: [{name: a, emulate: {memory_gb: 1e300}}]", "nodes[0].emulate.memory_gb: must be <= 1000000"),
    ("nodes: [{name: a, emulate: {memory_gb: 1e-30}}]", "nodes[0].emulate.memory_gb: must be >= 1e-09"),
    ("nodes: [{name: a, emulate: {speed: 1e-300}}]", "nodes[0].emulate.speed: must be >= 0.001"),
    ("nodes: [{name: a, emulate: {speed_changes: [{at_step: 1, speed: 1e-9}]}}]",
     "nodes[0].emulate.speed_changes[0].speed: must be >= 0.001"),
    ("nodes: [{name: a, region: x}, {name: b, region: y}]\nlinks: [{between: [x, y], emulate: {latency_ms: 1e300}}]",
     "links[0].emulate.latency_ms: must be <= 600000"),
    ("nodes: [{name: a, region: x}, {name: b, region: y}]\nlinks: [{between: [x, y], emulate: {bandwidth_mbps: 1e-300}}]",
     "links[0].emulate.bandwidth_mbps: must be >= 0.001"),
    ("nodes: [{name: a, device: 'cuda:99999999999999999999'}]", "nodes[0].device: must match"),
    ("train: {lr: 1e308}\nnodes: [{name: a}]", "train.lr: must be <= 1000"),
])
def test_emulation_and_training_numbers_past_any_real_use_are_refused(text: str, said: str) -> None:
    """Each passed validate and then failed `up` after its agents had started, in a raw Python
    message (timestamp out of range, cannot convert infinity to integer, torch's device parser),
    or trained to NaN at once without a word (a hostile review)."""
    assert said in error_of(text)


def test_several_errors_report_the_first_and_count() -> None:
    msg = error_of("train: {steps: 0, micro_batch_size: 0, schedule: zigzag}\nnodes: [{name: a}]")
    assert msg == "cluster.yaml: train.steps: must be >= 1 (got 0) (+2 more)"


def test_types_are_strict() -> None:
    assert "train.steps: must be an integer (got '5')" in error_of("train: {steps: '5'}\nnodes: [{name: a}]")
    assert "nodes[0].name: must be a string (got 7)" in error_of("nodes: [{name: 7}]")
    assert "nodes[0].device: must be a string (got true)" in error_of("nodes: [{name: a, device: yes}]")
    assert "nodes: must be a list (got a mapping)" in error_of("nodes: {name: a}")
    assert "train: must be a mapping" in error_of("train: [1]\nnodes: [{name: a}]")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "zb-h2", "auto"])
def test_every_schedule_is_accepted(schedule: str) -> None:
    assert parse_cluster(f"train: {{schedule: {schedule}}}\nnodes: [{{name: a}}]").train.schedule == schedule


def test_enumerations_and_patterns() -> None:
    assert "train.schedule: must be '1f1b', 'gpipe', 'zb-h1', 'zb-h2', 'interleaved-1f1b', 'zb-v' or 'auto' (got 'zigzag')" in \
        error_of("train: {schedule: zigzag}\nnodes: [{name: a}]")
    assert "nodes[0].launch: must be 'local', 'remote', 'ssh'" in error_of("nodes: [{name: a, launch: rsh}]")
    assert "nodes[0].host: required with launch: ssh" in error_of("nodes: [{name: a, launch: ssh}]")
    assert "nodes[0].host: must match" in error_of("nodes: [{name: a, launch: ssh, host: -oProxyCommand=x}]")
    assert "nodes[0].user: only with launch: ssh" in error_of("nodes: [{name: a, launch: remote, user: bob}]")
    assert "nodes[0].device: must match" in error_of("nodes: [{name: a, device: gpu}]")
    assert "name: must match [a-z0-9_-]+ (got 'Demo')" in error_of("name: Demo\nnodes: [{name: a}]")
    assert "nodes[0].name: must match" in error_of("nodes: [{name: 'a b'}]")


def test_nodes_required_and_nonempty() -> None:
    assert error_of("train: {steps: 1}") == ("cluster.yaml: nodes: list at least one node, or take agents as they come "
                                             "with discover:")
    assert "nodes: list at least one node" in error_of("nodes: []")
    assert "nodes: list at least one node" in error_of("nodes:")


def test_duplicate_node_names() -> None:
    assert "nodes[2].name: duplicate node name 'a' (also nodes[0])" in \
        error_of("nodes: [{name: a}, {name: b}, {name: a}]")


def test_duplicate_region_names() -> None:
    assert "regions[1].name: duplicate region 'r'" in error_of("regions: [{name: r}, {name: r}]\nnodes: [{name: a}]")


# ------------------------------------------------------------------ links


NODES_2_REGIONS = "nodes: [{name: a, region: r1}, {name: b, region: r2}]\n"


def test_link_to_unused_region() -> None:
    assert "links[0].between: region 'r3' is not used by any node (in use: r1, r2)" in \
        error_of(NODES_2_REGIONS + "links: [{between: [r1, r3]}]")
    # a region listed under regions: but used by no node is not enough
    assert "links[0].between: region 'r3' is not used" in \
        error_of(NODES_2_REGIONS + "regions: [{name: r3}]\nlinks: [{between: [r3, r1]}]")


def test_duplicate_link_pair_in_either_order() -> None:
    assert "links[1].between: duplicate link between r2 and r1 (also links[0])" in \
        error_of(NODES_2_REGIONS + "links: [{between: [r1, r2]}, {between: [r2, r1]}]")


def test_link_needs_two_distinct_regions() -> None:
    assert "links[0].between: needs two different regions" in error_of(NODES_2_REGIONS + "links: [{between: [r1, r1]}]")
    assert "links[0].between: must be a pair [a, b] (got 3 items)" in \
        error_of(NODES_2_REGIONS + "links: [{between: [r1, r2, r1]}]")
    assert "links[0].emulate.bandwidth_mbps: must be >= 0.001" in \
        error_of(NODES_2_REGIONS + "links: [{between: [r1, r2], emulate: {bandwidth_mbps: 0}}]")


# ------------------------------------------------------------------ local vs remote


def test_remote_node_with_emulate() -> None:
    assert "nodes[0].emulate: only local nodes can emulate" in \
        error_of("nodes: [{name: a, launch: remote, emulate: {speed: 0.5}}]")


def test_remote_node_with_threads() -> None:
    assert "nodes[0].threads: only for local nodes" in error_of("nodes: [{name: a, launch: remote, threads: 2}]")


def test_local_node_with_host() -> None:
    assert "nodes[0].host: only for remote or ssh nodes" in error_of("nodes: [{name: a, host: 10.0.0.1}]")


# ------------------------------------------------------------------ model


def test_unknown_preset_lists_valid_names() -> None:
    msg = error_of("model: {preset: huge}\nnodes: [{name: a}]")
    assert "model.preset: unknown preset 'huge' (valid: " in msg
    assert all(name in msg for name in PRESETS)


def test_d_model_not_divisible_by_n_heads() -> None:
    msg = error_of("model: {d_model: 62}\nnodes: [{name: a}]")
    assert "model.d_model: must be divisible by model.n_heads (got d_model 62, n_heads 4)" in msg


def test_entrypoint_with_preset_or_sizes() -> None:
    assert "model.preset: cannot be combined with model.entrypoint" in \
        error_of("model: {entrypoint: 'm:f', preset: tiny, kwargs: {seq_len: 8}}\nnodes: [{name: a}]")
    assert "model.n_layers: cannot be combined with model.entrypoint" in \
        error_of("model: {entrypoint: 'm:f', n_layers: 3, kwargs: {seq_len: 8}}\nnodes: [{name: a}]")


def test_entrypoint_format_and_seq_len() -> None:
    assert "model.entrypoint: must match" in error_of("model: {entrypoint: 'm.f', kwargs: {seq_len: 8}}\nnodes: [{name: a}]")
    assert "model.kwargs.seq_len: a positive integer is required" in \
        error_of("model: {entrypoint: 'm:f'}\nnodes: [{name: a}]")


def test_kwargs_without_entrypoint() -> None:
    assert "model.kwargs: only used with model.entrypoint" in error_of("model: {kwargs: {x: 1}}\nnodes: [{name: a}]")


# ------------------------------------------------------------------ layers (tiny preset: 4 blocks -> 6 stage layers)


def two_nodes(a: str, b: str) -> str:
    return f"nodes: [{{name: a, layers: {a}}}, {{name: b, layers: {b}}}]"


def test_layers_overlap() -> None:
    assert error_of(two_nodes("[0, 3]", "[2, 6]")) == \
        "cluster.yaml: nodes[1].layers: [2, 6) overlaps nodes[0].layers [0, 3)"


def test_layers_gap() -> None:
    assert error_of(two_nodes("[0, 3]", "[4, 6]")) == "cluster.yaml: layers leave [3, 4) unassigned"
    assert error_of(two_nodes("[0, 3]", "[3, 5]")) == "cluster.yaml: layers leave [5, 6) unassigned"
    assert error_of(two_nodes("[1, 3]", "[3, 6]")) == "cluster.yaml: layers leave [0, 1) unassigned"


def test_layers_out_of_range() -> None:
    assert "nodes[1].layers: [3, 7) is out of range; the model has layers [0, 6)" in error_of(two_nodes("[0, 3]", "[3, 7]"))


def test_layers_start_not_before_end() -> None:
    assert "nodes[0].layers: must be [start, end) with 0 <= start < end (got [3, 3))" in \
        error_of(two_nodes("[3, 3]", "[3, 6]"))
    assert "nodes[1].layers: must be [start, end)" in error_of(two_nodes("[0, 3]", "[-1, 6]"))
    assert "nodes[0].layers: must be a pair" in error_of("nodes: [{name: a, layers: [0, 3, 6]}]")


def test_layers_all_or_none() -> None:
    assert "nodes[1].layers: missing; either every node pins layers or none does (nodes[0] does)" in \
        error_of("nodes: [{name: a, layers: [0, 6]}, {name: b}]")


def test_more_nodes_than_layers() -> None:
    nodes = ", ".join(f"{{name: n{i}}}" for i in range(4))
    assert "nodes: 4 nodes but the model has only 3 stage layers" in error_of(f"model: {{n_layers: 1}}\nnodes: [{nodes}]")
    assert len(parse_cluster(f"model: {{n_layers: 2}}\nnodes: [{nodes}]").nodes) == 4


def test_entrypoint_layers_are_checked_later() -> None:
    # depth unknown until the entrypoint is built: only per-node sanity now, tiling at plan time
    cfg = parse_cluster("model: {entrypoint: 'm:f', kwargs: {seq_len: 8}}\n" + two_nodes("[0, 3]", "[5, 9]"))
    with pytest.raises(TilingError, match=r"^layers leave \[3, 5\) unassigned$"):
        check_layer_tiling([(n.name, *n.layers) for n in cfg.nodes], 9)


def test_check_layer_tiling_directly() -> None:
    check_layer_tiling([("b", 3, 6), ("a", 0, 3)], 6)
    for ranges, pattern in [
        ([("a", 0, 3), ("b", 2, 6)], r"^b: \[2, 6\) overlaps a \[0, 3\)$"),
        ([("a", 0, 3), ("b", 4, 6)], r"^layers leave \[3, 4\) unassigned$"),
        ([("a", 0, 3), ("b", 3, 8)], r"^b: \[3, 8\) is out of range"),
        ([("a", 0, 3), ("b", 3, 3)], r"^b: start must be < end"),
        ([("a", 0, 6), ("b", 0, 6)], r"^b: \[0, 6\) overlaps a"),
        ([], r"^layers leave \[0, 6\) unassigned$"),
    ]:
        with pytest.raises(TilingError, match=pattern):
            check_layer_tiling(ranges, 6)


@pytest.mark.parametrize("text, message", [
    ("train: {max_pipelines: 0}\nnodes: [{name: a}]", "train.max_pipelines: must be auto or an integer from 1 to 1,000,000,000 (got 0)"),
    ("train: {max_pipelines: many}\nnodes: [{name: a}]", "train.max_pipelines: must be auto or an integer from 1 to 1,000,000,000"),
    ("nodes: [{name: a, pipeline: 0}]", "nodes[0].pipeline: only with pinned layers"),
    ("nodes: [{name: a, layers: [0, 8], pipeline: 1}]", "no node is in pipeline 0"),
    ("train: {pipeline_microbatches: [3, 2]}\nnodes: [{name: a, layers: [0, 8]}, {name: b, layers: [0, 8], pipeline: 1}]",
     "train.pipeline_microbatches: [3, 2] must be >= 1 each and sum to num_microbatches (4)"),
    ("train: {pipeline_microbatches: [4]}\nnodes: [{name: a, layers: [0, 8]}, {name: b, layers: [0, 8], pipeline: 1}]",
     "train.pipeline_microbatches: has 1 entries for 2 pipelines"),
    ("train: {num_microbatches: 1}\nnodes: [{name: a, layers: [0, 8]}, {name: b, layers: [0, 8], pipeline: 1}]",
     "train.num_microbatches: 1 micro-batches cannot feed 2 pipelines"),
    ("nodes: [{name: a, layers: [0, 8]}, {name: b, layers: [0, 7], pipeline: 1}]",
     "layers leave [7, 8) unassigned"),
    ("train: {pipeline_microbatches: [2, 2]}\nnodes: [{name: a}]", "train.pipeline_microbatches: only when every node pins layers"),
])
def test_data_parallel_settings_errors(text: str, message: str) -> None:
    text = "model: {preset: tiny, n_layers: 6}\n" + text
    assert message in error_of(text)


def test_pinned_pipelines_grouped() -> None:
    cfg = cluster_from_dict({"model": {"n_layers": 6}, "train": {"pipeline_microbatches": [3, 1]},
                             "nodes": [{"name": "a", "layers": [0, 4]}, {"name": "b", "layers": [0, 8], "pipeline": 1},
                                       {"name": "c", "layers": [4, 8]}]})
    assert [[n.name for _, n in members] for members in cfg.pinned_pipelines()] == [["a", "c"], ["b"]]


def test_heartbeat_timeout_must_span_two_heartbeats() -> None:
    with pytest.raises(ConfigError, match=r"coordinator\.heartbeat_timeout_s: 1 must be at least twice"):
        parse_cluster("coordinator: {heartbeat_interval_s: 1, heartbeat_timeout_s: 1}\nnodes: [{name: a}]")


def test_metrics_port_and_coordinator_port_are_two_ports() -> None:
    """Both bind the coordinator's host: the gRPC server took the port first and `up` failed on
    the metrics server only after every node had profiled (a review)."""
    with pytest.raises(ConfigError, match=r"coordinator\.metrics_port: 9108 is coordinator\.port too"):
        parse_cluster("coordinator: {port: 9108, metrics_port: 9108}\nnodes: [{name: a}]")
    assert parse_cluster("coordinator: {port: 0, metrics_port: 0}\nnodes: [{name: a}]").coordinator.metrics_port == 0


TLS_TWO_REGIONS = """coordinator: {host: 0.0.0.0, tls: {cert: c.pem, key: k.pem}}
nodes: [{name: a, region: east, launch: remote}, {name: b, region: west, launch: remote}]
"""


def test_the_data_plane_is_sealed_across_regions_by_default_under_tls_and_off_needs_an_acknowledgement():
    assert parse_cluster(TLS_TWO_REGIONS).data_plane.encrypt == "cross_region"
    assert parse_cluster("nodes: [{name: a, region: east}, {name: b, region: west}]").data_plane.encrypt == "off"
    with pytest.raises(ConfigError, match=r"data_plane\.encrypt: off sends tensors between regions east, west in "
                                          r"clear text .* data_plane\.insecure: true"):
        parse_cluster(TLS_TWO_REGIONS + "data_plane: {encrypt: off}\n")
    assert parse_cluster(TLS_TWO_REGIONS + "data_plane: {encrypt: off, insecure: true}\n").data_plane.encrypt == "off"
    one_region = TLS_TWO_REGIONS.replace("region: west", "region: east") + "data_plane: {encrypt: off}\n"
    assert parse_cluster(one_region).data_plane.encrypt == "off"  # nothing crosses a region: nothing to acknowledge
    assert parse_cluster(TLS_TWO_REGIONS + "data_plane: {encrypt: all}\n").data_plane.encrypt == "all"


def test_a_home_relative_checkpoint_dir_or_data_file_means_the_users_home(monkeypatch, tmp_path) -> None:
    """`checkpoint.dir: ~/ck` made a folder named `~` where `up` ran, and `up --resume` from any other
    folder found no checkpoint (a hostile review); `data.path: ~/...` named no file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tokens.bin").write_bytes(b"some text to train on")
    cfg = parse_cluster("checkpoint: {dir: ~/ck}\ndata: {path: ~/tokens.bin}\nnodes: [{name: a}]")
    assert (cfg.checkpoint.dir, cfg.data.path) == (str(tmp_path / "ck"), str(tmp_path / "tokens.bin"))
    relative = parse_cluster("checkpoint: {dir: ck}\nnodes: [{name: a}]")
    assert relative.checkpoint.dir == "ck"  # relative paths stay relative to where `up` runs


def test_a_checkpoint_dir_through_a_symlink_loop_or_too_long_a_name_is_one_line(tmp_path) -> None:
    """Path.resolve raised RuntimeError ("Symlink loop") and OSError (a name too long, a folder the
    user may not search) out of the YAML's validation: tracebacks (a hostile review)."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for folder, said in ((tmp_path / "loop" / "ck", "loop"), (tmp_path / ("x" * 300) / "ck", "too long")):
        with pytest.raises(ConfigError) as caught:
            parse_cluster(f"checkpoint: {{dir: '{folder}'}}\nnodes: [{{name: a}}]")
        message = str(caught.value)
        assert "checkpoint.dir" in message and said in message.lower() and "\n" not in message, message
