"""Islands with DiLoCo outer steps train exactly as a single-process reference of k model copies.

Real processes end to end: `hetlaunch up` starts five agents in two islands. Island A is one
pipeline (a0: layers 0–1 | a1: 2–4); island B two pipelines (b0: 0–4 alone; c0: 0–2 | c1: 3–4),
which sync gradients every step inside B only. The model is Hugging Face GPT-2 with its tied
embedding and head (on different stages). Every H steps each layer's holders in all three
islands exchange their change since the last outer step (island B's through its first pipeline's
holder, which passes the average on inside B), weighted by the islands' micro-batches, and step
the anchor with outer Nesterov SGD.

The reference is written here: two copies of the model, each trained with AdamW (and its own
clipping) on its island's micro-batches of the step, and the outer step done by hand on the
per-island deltas in island order, with the same codec and error feedback (the codec is
hetlaunch's: what is under test is the outer step, not the codec, which tests/stage/test_codecs.py
covers). Losses per step and final parameters must agree to rel 1e-5.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import final_parameters, run_hetlaunch
from hetlaunch.runtime.codecs import codec_by_id
from hetlaunch.runtime.data import TokenBatches, stdlib_text_bytes
from hetlaunch.runtime.model import load_entrypoint_layers
from hetlaunch.runtime.wire import codec_wire_id

pytest.importorskip("transformers")

EP = "hf_pair_model:gpt2_layers"
KW = {"seq_len": 16, "n_layer": 3, "n_embd": 32, "n_head": 4, "vocab_size": 256}  # 5 layers: emb, 3 blocks, head
NUM_LAYERS = 5
SEED, DATA_SEED, LR, WD, CLIP = 5, 2, 3e-3, 0.01, 0.5
MICRO = 2
SHARES = [3, 2, 1]                 # pipelines a, b, c; islands A and B 3 micro-batches each (B: 2 + 1)
ISLAND_OF = [0, 1, 1]
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9

# Not a test of loss detection: a generous heartbeat timeout, so a node starved of CPU on a loaded
# machine is not declared lost (the full suite beside a busy loop once lost a1 before its first step,
# and the run, recovered on the nodes left, trained other pipelines than the reference's).
CLUSTER = """name: islands
coordinator: {{heartbeat_timeout_s: 30}}
model: {{entrypoint: {ep}, kwargs: {kw}}}
data: {{seed: {data_seed}}}
train:
  steps: {steps}
  micro_batch_size: {micro}
  num_microbatches: {total}
  pipeline_microbatches: {shares}
  lr: {lr}
  weight_decay: {wd}
  grad_clip: {clip}
  seed: {seed}
  outer: {{islands: [[a0, a1], [b0, c0, c1]], every: {every}, codec: {codec}, fragments: {fragments}, delay: {delay},
           alpha: {alpha}}}
compression: {{intra_region: none, cross_region: none, sync: none}}
nodes:
  - {{name: a0, device: cpu, threads: 1, pipeline: 0, layers: [0, 2]}}
  - {{name: a1, device: cpu, threads: 1, pipeline: 0, layers: [2, 5]}}
  - {{name: b0, device: cpu, threads: 1, pipeline: 1, layers: [0, 5]}}
  - {{name: c0, device: cpu, threads: 1, pipeline: 2, layers: [0, 3]}}
  - {{name: c1, device: cpu, threads: 1, pipeline: 2, layers: [3, 5]}}
"""


def _layer_of(net: nn.Sequential) -> dict[int, int]:
    """id(parameter) -> the layer whose fragment it takes: a tied one's first holder (layer 0)."""
    out: dict[int, int] = {}
    for index, layer in enumerate(net):
        for p in layer.parameters():
            out.setdefault(id(p), index)
    return out


def reference(steps: int, every: int, codec: str, fragments: int, delay: int, alpha: float):
    """Per-step losses (all micro-batches' mean), per-island losses, and island A's final parameters."""
    torch.set_num_threads(1)
    copies = [nn.Sequential(*load_entrypoint_layers(EP, KW, SEED)[0]) for _ in range(2)]
    assert copies[0][0].wte.weight is copies[0][4].lm_head.weight  # the tie, one Parameter
    params = [list(net.parameters()) for net in copies]  # the same order in both copies
    layer_of = _layer_of(copies[0])
    fragment = [layer_of[id(p)] * fragments // NUM_LAYERS for p in params[0]]
    optimizers = [torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": WD},
                                     {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
                  for ps in params]
    anchor = [p.detach().clone() for p in params[0]]
    momentum = [torch.zeros_like(p) for p in anchor]
    errors = [[torch.zeros_like(p) for p in anchor] for _ in range(2)]  # per island (its representative's)
    the_codec = codec_by_id(codec_wire_id(codec))
    weights = [sum(s for s, i in zip(SHARES, ISLAND_OF) if i == island) / sum(SHARES) for island in range(2)]
    batches = TokenBatches(stdlib_text_bytes(), KW["seq_len"], seed=DATA_SEED)
    pending: list[tuple[int, list[int], list[torch.Tensor]]] = []  # (apply after, indices, averaged deltas)
    losses, island_losses = [], []
    for step in range(steps):
        micro = batches.micro_batches(step, MICRO, sum(SHARES))
        island_micro = [micro[:3], micro[3:]]  # pipelines in order: a takes 3, then b 2 and c 1
        all_losses, per_island = [], []
        for net, opt, ps, mine in zip(copies, optimizers, params, island_micro):
            step_losses = []
            for x, y in mine:
                loss = nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
                (loss / len(mine)).backward()
                step_losses.append(loss.item())
            nn.utils.clip_grad_norm_(ps, CLIP)
            opt.step()
            opt.zero_grad()
            all_losses += step_losses
            per_island.append(sum(step_losses) / len(step_losses))
        losses.append(sum(all_losses) / len(all_losses))
        island_losses.append(per_island)
        done = step + 1

        def launch(f: int) -> None:
            indices = [i for i in range(len(anchor)) if fragment[i] == f]
            averaged = []
            for i in indices:
                total = torch.zeros_like(anchor[i])
                for island, weight in enumerate(weights):
                    delta = anchor[i] - params[island][i].detach()
                    if codec != "none":
                        delta = delta + errors[island][i]
                    decoded = the_codec.decode(the_codec.encode(delta), tuple(delta.shape), delta.dtype)
                    if codec != "none":
                        errors[island][i] = delta - decoded
                    total += weight * decoded
                averaged.append(total)
            pending.append((done + delay, indices, averaged))

        def apply(entry, mix: float) -> None:
            pending.remove(entry)
            _, indices, averaged = entry
            with torch.no_grad():
                for i, average in zip(indices, averaged):
                    momentum[i].mul_(OUTER_MOMENTUM).add_(average)
                    anchor[i].sub_(OUTER_LR * (average + OUTER_MOMENTUM * momentum[i]))
                    for island in (range(2) if mix is not None else ()):  # None: the anchor alone
                        p = params[island][i]
                        p.copy_(anchor[i] if mix == 0 else mix * p + (1 - mix) * anchor[i])

        launched_now = [f for f in range(fragments)
                        if done >= (f + 1) * every // fragments and (done - (f + 1) * every // fragments) % every == 0]
        for f in launched_now:
            launch(f)
        for entry in [e for e in pending if e[0] <= done]:
            apply(entry, alpha)
        if done == steps:  # training ends with an outer step of every other fragment, applied whole
            for entry in [e for e in pending if e[0] - delay != done]:  # still waiting: the anchor first
                apply(entry, None)
            for f in range(fragments):
                if f not in launched_now:
                    launch(f)
            for entry in list(pending):
                apply(entry, 0.0)
    return losses, island_losses, copies[0], {"anchor": anchor, "momentum": momentum, "params": params[0]}


def _run(tmp_path, steps, every, codec, fragments, delay, alpha):
    yaml = CLUSTER.format(ep=EP, kw=json.dumps(KW), data_seed=DATA_SEED, steps=steps, micro=MICRO, total=sum(SHARES),
                          shares=SHARES, lr=LR, wd=WD, clip=CLIP, seed=SEED, every=every, codec=codec,
                          fragments=fragments, delay=delay, alpha=alpha)
    (tmp_path / "cluster.yaml").write_text(yaml)
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), timeout=360)
    assert result.returncode == 0, result.stderr + result.stdout
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["events"] = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    summary["run_dir"] = str(run_dir)
    return lines, final_parameters(run_dir), summary


def _checkpoint_state(run_dir) -> dict:
    from hetlaunch.runtime.checkpoint import load_layers
    from hetlaunch.runtime.checkpoint_manifest import latest_checkpoint

    directory, manifest = latest_checkpoint(run_dir / "checkpoints")
    return load_layers(directory, manifest, 0, manifest.num_layers)


def _check(lines, params, steps, want, atol=1e-5):
    losses, island_losses, net, _ = want
    assert [r["step"] for r in lines] == list(range(steps))
    for got, ref in zip(lines, losses):
        assert abs(got["loss"] - ref) / ref <= 1e-5, ([r["loss"] for r in lines], losses)
    for got, ref in zip(lines, island_losses):
        for g, r in zip(got["islands"]["losses"], ref):
            assert abs(g - r) / r <= 1e-5, ([x["islands"]["losses"] for x in lines], island_losses)
    # The islands trained apart: their losses differ (else an outer step every step would pass too).
    assert any(abs(a - b) > 1e-4 for a, b in island_losses)
    # Island A's stages wrote the checkpoint: its weights after the last (applied) outer step. The
    # tolerance is absolute 1e-5: AdamW's division by sqrt(v) lifts float32 rounding of near-zero
    # gradients (summed in another order across a cut) to ~1e-6 on a few elements.
    assert torch.equal(params["layers.0.wte.weight"], params["layers.4.lm_head.weight"])  # still one tied weight
    for index, layer in enumerate(net):
        for name, value in layer.named_parameters():
            torch.testing.assert_close(params[f"layers.{index}.{name}"], value.detach(), rtol=1e-5, atol=atol,
                                       msg=lambda m, n=f"{index}.{name}": f"{n}: {m}")


@pytest.mark.timeout(420)
def test_islands_with_outer_nesterov_steps_equal_k_copies_in_one_process(tmp_path):
    steps, every = 9, 3
    lines, params, summary = _run(tmp_path, steps, every, "none", 1, 0, 0.0)
    want = reference(steps, every, "none", 1, 0, 0.0)
    _check(lines, params, steps, want)
    # The checkpoint keeps the anchor and the outer momentum (a resume continues the outer optimizer).
    state = _checkpoint_state(tmp_path / "run")
    position = {id(p): i for i, p in enumerate(want[2].parameters())}  # the tie's two names share one
    names = {f"{index}.{name}": position[id(p)] for index, layer in enumerate(want[2])
             for name, p in layer.named_parameters()}
    for name, i in names.items():
        for field in ("anchor", "momentum"):
            torch.testing.assert_close(state[f"outer.{name}.{field}"], want[3][field][i], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=f"{name}.{field}": f"{n}: {m}")
    assert any(state[f"outer.{n}.momentum"].abs().max() > 0 for n in names)  # three outer steps moved it
    assert summary["plan"]["islands"] == ISLAND_OF and summary["plan"]["outer"]["every"] == every
    outer = [r["islands"]["outer"] for r in lines]
    assert [o["launched"] for o in outer] == [1 if (s + 1) % every == 0 else 0 for s in range(steps)]
    # Observed: an event per outer step, and the run's exchanges in the summary.
    events = [e for e in summary["events"] if e["event"] == "outer_step"]
    assert [e["step"] + 1 for e in events] == [3, 6, 9]
    assert summary["outer"]["exchanges_launched"] == 3
    assert summary["outer"]["wire_bytes"] == sum(o["bytes"][1] for o in outer)
    report = run_hetlaunch("report", summary["run_dir"], timeout=120)  # each island's curve in training.png
    assert report.returncode == 0 and (tmp_path / "run" / "report" / "training.png").stat().st_size > 0, report.stderr
    # One delta per island crosses: each island's representative sends its fp32 delta to the other's
    # (island B's second holder gets the average from its representative, inside B).
    # Every parameter a stage holds, the tie's two copies too (each holder exchanges its own).
    model_bytes = sum(v.numel() * 4 for v in params.values())
    assert all(o["bytes"] == [2 * model_bytes, 2 * model_bytes] for o in outer if o["launched"]), (outer, model_bytes)


@pytest.mark.timeout(420)
def test_streaming_fragments_with_a_delay_and_int8_deltas_equal_the_reference(tmp_path):
    steps, every, fragments, delay, alpha = 12, 4, 2, 1, 0.5
    lines, params, _ = _run(tmp_path, steps, every, "int8", fragments, delay, alpha)
    # Parameters to 1e-4: a delta within float32 rounding of an int8 rounding boundary may land one
    # level (max |delta| / 127 of its 64-value block) away in one run; error feedback carries it on.
    _check(lines, params, steps, reference(steps, every, "int8", fragments, delay, alpha), atol=1e-4)
    launched = [r["islands"]["outer"]["launched"] for r in lines]
    assert [s + 1 for s in range(steps) if launched[s]] == [2, 4, 6, 8, 10, 12]  # the fragments take turns ...
    assert launched[-1] == 2  # ... and at the end both meet: fragment 1 as due, fragment 0 once more
    sent = [r["islands"]["outer"]["bytes"] for r in lines if r["islands"]["outer"]["launched"]]
    assert all(wire < 0.3 * raw for raw, wire in sent)  # int8 + scales: ~0.27 of fp32


@pytest.mark.timeout(420)
def test_a_run_that_ends_while_an_exchange_waits_out_its_delay_ends_on_the_right_anchor(tmp_path):
    """Fragment 0 launches after step 10 with a delay of 2: at the end (step 11) it still waits.
    It is applied to the anchor first, then both fragments meet once more. Until 2026-12-06 the
    last exchange was launched before the waiting one was applied and counted the islands' change
    up to step 10 twice (a hostile review: held-out loss 6.5 at the end where 4.5 was right)."""
    steps, every, fragments, delay, alpha = 11, 4, 2, 2, 0.5
    lines, params, _ = _run(tmp_path, steps, every, "none", fragments, delay, alpha)
    _check(lines, params, steps, reference(steps, every, "none", fragments, delay, alpha))
    launched = [r["islands"]["outer"]["launched"] for r in lines]
    assert [s + 1 for s in range(steps) if launched[s]] == [2, 4, 6, 8, 10, 11]
    assert launched[-1] == 2 and lines[-1]["islands"]["outer"]["applied"] == 3  # the waiting one and both last


@pytest.mark.timeout(420)
def test_the_islands_example_is_planned_as_two_islands_that_meet_every_ten_steps(tmp_path):
    """The planner's path as a user runs it: cluster_examples/islands.yaml (three local nodes in two
    regions over an emulated slow link), profiled and planned, fewer steps."""
    import yaml

    from conftest import REPO

    cluster = yaml.safe_load((REPO / "cluster_examples" / "islands.yaml").read_text())
    cluster["train"].update(steps=24, eval_every=0)
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), timeout=360)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "island 1:" in result.stdout and "outer step every 10 steps" in result.stdout, result.stdout
    plan = json.loads((run_dir / "summary.json").read_text())["plan"]
    regions = {"east-a": "us-east", "east-b": "us-east", "west-a": "eu-west"}
    islands = {}
    for stage in plan["stages"]:
        islands.setdefault(plan["islands"][stage["pipeline"]], set()).add(regions[stage["node"]])
    assert sorted(map(sorted, islands.values())) == [["eu-west"], ["us-east"]]  # one island per region
    assert plan["outer"]["every"] == 10 and plan["outer"]["exchange_s"] > 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] + 1 for r in lines if r["islands"]["outer"]["launched"]] == [10, 20, 24]  # and at the end
    assert lines[-1]["loss"] < lines[0]["loss"]
