"""Parameters shared between layers in the `(layers, loss_fn)` form are tied across stages:
Hugging Face GPT-2 as a user brings it (`lm_head.weight` is `wte.weight`, one Parameter), cut
so the embedding and the head sit on the first and last of three stages, trains as the tied
model in one process, step by step (issue 23: it used to train two silent copies)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import final_parameters, run_hetlaunch
from fixed_profile_cache import fixed_timings_env
from hetlaunch.runtime.data import TokenBatches, stdlib_text_bytes
from hetlaunch.runtime.model import build_layer, describe_model, load_entrypoint_layers
from hetlaunch.runtime.model_spec import ModelSpec

pytest.importorskip("transformers")

EP = "hf_pair_model:gpt2_layers"
KW = {"seq_len": 16, "n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256}
SEED, DATA_SEED, STEPS, LR, WD, CLIP = 5, 2, 20, 3e-3, 0.01, 0.5
MICRO, NUM_MICRO = 2, 4
TIE = ("0.wte.weight", "3.lm_head.weight")

CLUSTER = f"""name: hf-pair
model: {{entrypoint: {EP}, kwargs: {json.dumps(KW)}}}
data: {{seed: {DATA_SEED}}}
train: {{steps: {STEPS}, micro_batch_size: {MICRO}, num_microbatches: {NUM_MICRO}, lr: {LR}, weight_decay: {WD},
         grad_clip: {CLIP}, seed: {SEED}, schedule: SCHEDULE}}
compression: {{intra_region: none, cross_region: none}}
nodes:
  - {{name: head, device: cpu, threads: 1, layers: [0, 1]}}
  - {{name: body, device: cpu, threads: 1, layers: [1, 3]}}
  - {{name: tail, device: cpu, threads: 1, layers: [3, 4]}}
"""


def test_sharing_is_found_when_the_model_is_described_and_each_layer_gets_its_own_copy():
    model = describe_model(ModelSpec(entrypoint=EP, kwargs=KW), seed=SEED)  # on the meta device
    assert model.num_layers == 4 and model.tied == (TIE,)
    embedding, head = build_layer(model, 0, SEED), build_layer(model, 3, SEED)
    assert embedding.wte.weight is not head.lm_head.weight  # a stage holds its own copy ...
    assert torch.equal(embedding.wte.weight, head.lm_head.weight)  # ... of the one value


def reference():
    """One process, the tie as Hugging Face makes it: one Parameter, counted once everywhere."""
    torch.set_num_threads(1)
    net = nn.Sequential(*load_entrypoint_layers(EP, KW, SEED)[0])
    assert net[0].wte.weight is net[3].lm_head.weight
    params = list(net.parameters())  # the tied weight once
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
    batches = TokenBatches(stdlib_text_bytes(), KW["seq_len"], seed=DATA_SEED)
    losses, norms = [], []
    for step in range(STEPS):
        step_losses = []
        for x, y in batches.micro_batches(step, MICRO, NUM_MICRO):
            loss = nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
            (loss / NUM_MICRO).backward()
            step_losses.append(loss.item())
        norms.append(float(nn.utils.clip_grad_norm_(params, CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(step_losses) / NUM_MICRO)
    return losses, norms, net


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2"])
def test_hf_gpt2_tied_through_the_layers_form_over_three_stages_equals_one_process(tmp_path, schedule):
    (tmp_path / "cluster.yaml").write_text(CLUSTER.replace("SCHEDULE", schedule))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), timeout=260)
    assert result.returncode == 0, result.stderr + result.stdout
    _equals_one_process(run_dir)


def _equals_one_process(run_dir) -> None:
    """Every step's loss and clipped gradient norm, and the final tied weight, are the one-process
    tied model's (rel 1e-5)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(STEPS))
    want, norms, net = reference()
    assert all(n > CLIP for n in norms)  # the clip acts: a tie counted twice in the norm would show
    for got, ref in zip(lines, want):
        assert abs(got["loss"] - ref) / ref <= 1e-5, ([r["loss"] for r in lines], want)
    for got, ref in zip(lines, norms):
        assert abs(got["grad_norm"] - ref) / ref <= 1e-5, ([r["grad_norm"] for r in lines], norms)
    params = final_parameters(run_dir)
    # The two copies took the same updates: still one weight, and the one the single process has.
    assert torch.equal(params["layers.0.wte.weight"], params["layers.3.lm_head.weight"])
    torch.testing.assert_close(params["layers.0.wte.weight"], net[0].wte.weight.detach(), rtol=1e-5, atol=1e-6)
    start = load_entrypoint_layers(EP, KW, SEED)[0][0].wte.weight
    assert not torch.allclose(start, params["layers.0.wte.weight"])  # it trained: "equal" means something


def test_a_shared_submodule_and_three_holders_are_one_group_each_layer_its_own_copy():
    from hetlaunch.runtime.shared_params import shared_groups, untie

    emb = nn.Embedding(10, 4)
    frozen = nn.Parameter(torch.ones(3), requires_grad=False)
    layers = [nn.ModuleDict({"emb": emb}), nn.ModuleDict({"same": emb, "also": emb}), nn.Linear(4, 10)]
    layers[2].weight = emb.weight  # a third holder of the one weight
    layers[0].register_parameter("frozen", frozen)
    layers[2].register_parameter("frozen", frozen)  # frozen: equal in every copy without a tie
    groups = shared_groups(layers)
    assert groups == (("0.emb.weight", "1.same.weight", "2.weight"),)
    own = untie(layers, groups)
    assert own[0] is layers[0] and own[0].emb.weight is emb.weight
    assert own[1].same is own[1].also and own[1].same.weight is not emb.weight  # sharing inside a layer kept
    assert own[2].weight is not emb.weight and torch.equal(own[2].weight, emb.weight)


def test_a_layer_that_cannot_be_copied_is_refused_in_one_line_naming_the_shared_parameters():
    import threading

    from hetlaunch.runtime.shared_params import shared_groups, untie

    class Locked(nn.Module):
        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.weight, self.lock = weight, threading.Lock()  # a lock cannot be deep-copied

    emb = nn.Embedding(10, 4)
    layers = [emb, Locked(emb.weight)]
    with pytest.raises(ValueError, match=r"^layers share parameters \(0\.weight, 1\.weight\) and layer 1 cannot be "
                                         r"copied .* declare LayeredModel\(tied=\.\.\.\) instead$"):
        untie(layers, shared_groups(layers))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_tied_gpt2_with_several_stages_per_node_equals_one_process(tmp_path, schedule):
    """The same model on two nodes, each holding two of the four one-layer stages. Under ZB-V the
    embedding (stage 0) and the head (stage 3) are both on the first node: their gradients are summed
    in its process. Interleaved 1F1B puts them on different nodes: summed over the network, as with
    one stage per node. Either way the run is the tied model in one process, step by step."""
    # Unpinned (these schedules cut their own stages); alike nodes at a tenth of their speed keep the
    # planner on both (tests/job/test_device_schedules_up.py says why)
    nodes = "\n".join(f"  - {{name: n{i}, device: cpu, threads: 1, emulate: {{speed: 0.1}}}}" for i in range(2))
    cluster = CLUSTER.replace("SCHEDULE", schedule).split("nodes:")[0] + "nodes:\n" + nodes + "\n"
    (tmp_path / "cluster.yaml").write_text(cluster.replace("schedule:", "rebalance: off, schedule:"))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), timeout=260)
    assert result.returncode == 0, result.stderr + result.stdout
    plan = json.loads((run_dir / "summary.json").read_text())["plan"]
    where = [s["node"] for s in plan["stages"]]
    assert len(where) == 4 and len(set(where)) == 2, where
    assert (where[0] == where[3]) == (schedule == "zb-v"), where  # the tie on one node, or across two
    _equals_one_process(run_dir)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_tied_gpt2_in_two_pipelines_of_several_stages_per_node_equals_one_process(tmp_path, schedule):
    """`max_pipelines: 2` on four alike nodes: two pipelines of two nodes, each holding two of its
    four one-layer stages, two micro-batches each. The tie is summed inside each pipeline (in one
    process under ZB-V, over the network under interleaved 1F1B), each layer's gradients between the
    pipelines, and the clipping norm counts the tie once and the model once: the run is the tied
    model in one process. The layer timings the planner reads are fixed (tests/fixed_profile_cache.py):
    at 100 ms a layer it takes two pipelines of two nodes (0.6 s a step) over one of four (0.7 s)."""
    nodes = "\n".join(f"  - {{name: n{i}, device: cpu, threads: 1}}" for i in range(4))
    cluster = CLUSTER.replace("SCHEDULE", schedule).split("nodes:")[0] + "nodes:\n" + nodes + "\n"
    cluster = cluster.replace("schedule:", "rebalance: off, max_pipelines: 2, schedule:")
    env = fixed_timings_env(tmp_path, cluster, 4)
    (tmp_path / "cluster.yaml").write_text(cluster)
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), timeout=400, env=env)
    assert result.returncode == 0, result.stderr + result.stdout
    plan = json.loads((run_dir / "summary.json").read_text())["plan"]
    assert plan["pipeline_microbatches"] == [2, 2], plan
    for p in (0, 1):
        where = [s["node"] for s in plan["stages"] if s["pipeline"] == p]
        assert len(where) == 4 and len(set(where)) == 2, where
        assert (where[0] == where[3]) == (schedule == "zb-v"), where  # the tie on one node, or across two
    _equals_one_process(run_dir)
