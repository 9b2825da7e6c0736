"""`hetlaunch deploy k8s`: the manifests it renders are valid Kubernetes objects (checked against the
schemas of one fixed Kubernetes version, strictly: an unknown field fails), carry what the YAML asked
for, keep the token out of every command line, and would be taken by the YAML's discover: rule.
Bad input is one line. Nothing here runs a Kubernetes cluster."""

from __future__ import annotations

import copy
import os
import re
import stat

import kubernetes_validate
import pytest
import yaml

from conftest import REPO, error_of, hetlaunch_env, run_hetlaunch
from hetlaunch.launcher.cluster_yaml import cluster_from_dict, load_cluster
from hetlaunch.launcher.discovery import Discovery, discovered_node
from hetlaunch.launcher.providers.kubernetes_deploy import DeployError, deploy
from hetlaunch.protos import control_pb2 as pb

K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37 bundles; fixed so a new release cannot move it
TOKEN = "k8s-test-token-0123456789"

CLUSTER = {
    "name": "geo",
    "coordinator": {"host": "0.0.0.0", "advertise": "203.0.113.10", "port": 29400, "insecure": True},
    "discover": {"min_nodes": 3, "regions": ["us-east", "eu-west"], "labels": {"pool": "k8s"}},
    "kubernetes": {
        "image": "ghcr.io/example/hetlaunch:0.1.0",
        "agent_args": ["--data-root", "/data"],
        "groups": [
            {"name": "a100", "region": "us-east", "gpu_type": "NVIDIA-A100-SXM4-80GB", "gpus_per_pod": 8,
             "labels": {"pool": "k8s"}},
            {"name": "l4", "replicas": 2, "region": "eu-west", "gpu_type": "NVIDIA-L4",
             "labels": {"pool": "k8s", "cost": "$(HOME)"},  # a '$' of the YAML must not expand in the pod
             "node_selector": {"cloud.google.com/gke-spot": "true"}, "image": "registry.local/het:cu12"},
            {"name": "cpu", "region": "eu-west", "gpus_per_pod": 0, "labels": {"pool": "k8s"}},
        ],
    },
}


def write_cluster(tmp_path, data=CLUSTER, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def rendered(out):
    """Every document of every YAML file in `out`, by file name."""
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted(out.iterdir()) if p.suffix == ".yaml"}


def workloads(docs):
    return {d["metadata"]["name"]: d for file in docs.values() for d in file if d["kind"] == "StatefulSet"}


def test_every_manifest_is_valid_against_the_kubernetes_schemas(tmp_path):
    deploy(cluster_from_dict(CLUSTER), tmp_path / "k8s", None, "cluster.yaml")
    docs = rendered(tmp_path / "k8s")
    assert sorted(docs) == ["group-a100.yaml", "group-cpu.yaml", "group-l4.yaml", "secret.yaml"]
    kinds = []
    for file in docs.values():
        for doc in file:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            kinds.append(doc["kind"])
            assert "namespace" not in doc["metadata"]  # applied into whichever namespace kubectl is told
    assert sorted(kinds) == ["Secret"] + ["Service"] * 3 + ["StatefulSet"] * 3
    # the check has teeth: a misspelt field is refused in strict mode
    broken = copy.deepcopy(workloads(docs)["l4"])
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_groups_get_their_selectors_gpus_and_agent_flags(tmp_path):
    deploy(cluster_from_dict(CLUSTER), tmp_path, None, "cluster.yaml")
    sets = workloads(rendered(tmp_path))
    a100, l4, cpu = (sets[n]["spec"] for n in ("a100", "l4", "cpu"))
    assert (a100["replicas"], l4["replicas"], cpu["replicas"]) == (1, 2, 1)
    pod = l4["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true", "topology.kubernetes.io/region": "eu-west",
                                   "nvidia.com/gpu.product": "NVIDIA-L4"}
    container = pod["containers"][0]
    assert container["image"] == "registry.local/het:cu12"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert a100["template"]["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert a100["template"]["spec"]["containers"][0]["image"] == "ghcr.io/example/hetlaunch:0.1.0"
    assert "resources" not in cpu["template"]["spec"]["containers"][0]  # no GPU asked for, none limited
    assert "tolerations" not in cpu["template"]["spec"]
    assert cpu["template"]["spec"]["nodeSelector"] == {"topology.kubernetes.io/region": "eu-west"}
    assert container["command"] == ["hetlaunch"]
    assert container["args"] == [
        "agent", "--serve", "--coordinator", "203.0.113.10:29400", "--name", "$(POD_NAME)",
        "--token-file", "/etc/hetlaunch/token", "--region", "eu-west",
        "--label", "cost=$$(HOME)", "--label", "pool=k8s", "--insecure", "--data-root", "/data"]
    assert container["env"] == [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    assert pod["automountServiceAccountToken"] is False


def test_the_token_is_in_the_secret_and_on_no_command_line(tmp_path):
    token_file = tmp_path / "join-token"
    token_file.write_text(TOKEN + "\n")
    done = deploy(cluster_from_dict(CLUSTER), tmp_path / "k8s", token_file, "cluster.yaml")
    assert done.new_token is None and not (tmp_path / "k8s" / "token").exists()
    docs = rendered(tmp_path / "k8s")
    (secret,) = docs["secret.yaml"]
    assert secret["stringData"] == {"token": TOKEN}
    assert stat.S_IMODE(os.stat(tmp_path / "k8s" / "secret.yaml").st_mode) == 0o600
    for name, workload in workloads(docs).items():
        pod = workload["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert TOKEN not in yaml.safe_dump(workload), name  # not in args, command, env or anywhere else
        assert pod["volumes"] == [{"name": "hetlaunch-secret", "secret": {"secretName": secret["metadata"]["name"],
                                                                          "defaultMode": 0o400}}]
        assert container["volumeMounts"][0]["mountPath"] == "/etc/hetlaunch"


def test_without_a_token_one_is_made_and_written_beside_the_manifests(tmp_path, monkeypatch):
    monkeypatch.delenv("HETLAUNCH_TOKEN", raising=False)
    done = deploy(cluster_from_dict(CLUSTER), tmp_path, None, "cluster.yaml")
    token = (tmp_path / "token").read_text().strip()
    assert done.new_token == tmp_path / "token" and len(token) >= 32
    assert stat.S_IMODE(os.stat(tmp_path / "token").st_mode) == 0o600
    assert rendered(tmp_path)["secret.yaml"][0]["stringData"]["token"] == token
    # Rendered again into the same directory: the same token (a new one silently locked out the
    # agents already running and any `up --token-file DIR/token` started before), the same digest.
    digest = workloads(rendered(tmp_path))
    again = deploy(cluster_from_dict(CLUSTER), tmp_path, None, "cluster.yaml")
    assert again.new_token is None and (tmp_path / "token").read_text().strip() == token
    assert workloads(rendered(tmp_path)) == digest
    monkeypatch.setenv("HETLAUNCH_TOKEN", TOKEN)
    assert deploy(cluster_from_dict(CLUSTER), tmp_path / "env", None, "cluster.yaml").new_token is None
    assert rendered(tmp_path / "env")["secret.yaml"][0]["stringData"]["token"] == TOKEN


def test_discover_takes_every_rendered_agent(tmp_path):
    cluster = cluster_from_dict(CLUSTER)
    deploy(cluster, tmp_path, None, "cluster.yaml")
    discovery = Discovery(cluster.discover, limit=None)
    for name, workload in workloads(rendered(tmp_path)).items():
        args = workload["spec"]["template"]["spec"]["containers"][0]["args"]
        region = args[args.index("--region") + 1]
        labels = dict(a.replace("$$", "$").split("=", 1)  # as Kubernetes hands them to the agent
                      for a, flag in zip(args[1:], args) if flag == "--label")
        for k in range(workload["spec"]["replicas"]):  # what the pod's agent announces: its pod name
            info = pb.AgentInfo(node_name=f"{name}-{k}", region=region, labels=labels)
            assert discovery.admit(info) is None, name
    assert sorted(discovery.taken) == ["a100-0", "cpu-0", "l4-0", "l4-1"]
    joined = cluster.with_discovered([discovered_node(pb.AgentInfo(node_name=n, region="eu-west"))
                                      for n in discovery.taken])  # what `up` validates once they joined
    assert len(joined.nodes) == 4 and joined.kubernetes is None and joined.discover is None


def test_tls_puts_the_ca_and_the_agents_pair_in_the_secret(tmp_path):
    for name in ("ca.pem", "server.pem", "server.key", "agent.pem", "agent.key"):
        (tmp_path / name).write_text(f"-----BEGIN X-----\n{name}\n-----END X-----\n")
    data = copy.deepcopy(CLUSTER)
    data["coordinator"] = {"host": "0.0.0.0", "advertise": "coord.example.org", "port": 29400,
                           "tls": {k: str(tmp_path / v) for k, v in (("cert", "server.pem"), ("key", "server.key"),
                                   ("ca", "ca.pem"), ("agent_cert", "agent.pem"), ("agent_key", "agent.key"))}}
    deploy(cluster_from_dict(data), tmp_path / "k8s", None, "cluster.yaml")
    docs = rendered(tmp_path / "k8s")
    secret = docs["secret.yaml"][0]["stringData"]
    assert sorted(secret) == ["agent-cert.pem", "agent-key.pem", "ca.pem", "token"]
    assert "agent.key" in secret["agent-key.pem"] and "ca.pem" in secret["ca.pem"]
    args = workloads(docs)["a100"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--ca"):args.index("--ca") + 6] == [
        "--ca", "/etc/hetlaunch/ca.pem", "--cert", "/etc/hetlaunch/agent-cert.pem",
        "--key", "/etc/hetlaunch/agent-key.pem"]
    assert args[args.index("--coordinator") + 1] == "coord.example.org:29400"
    (tmp_path / "agent.key").unlink()
    with pytest.raises(DeployError, match=r"^coordinator.tls.agent_key: cannot read .*agent.key \(no such file\)"):
        deploy(cluster_from_dict(data), tmp_path / "k8s", None, "cluster.yaml")


def _tls_cluster(tmp_path, agent_key) -> dict:
    for name in ("ca.pem", "server.pem", "server.key", "agent.pem"):
        (tmp_path / name).write_text(f"-----BEGIN X-----\n{name}\n-----END X-----\n")
    data = copy.deepcopy(CLUSTER)
    data["coordinator"] = {"host": "0.0.0.0", "advertise": "coord.example.org", "port": 29400,
                           "tls": {"cert": str(tmp_path / "server.pem"), "key": str(tmp_path / "server.key"),
                                   "ca": str(tmp_path / "ca.pem"), "agent_cert": str(tmp_path / "agent.pem"),
                                   "agent_key": str(agent_key)}}
    return data


@pytest.mark.timeout(30)
def test_a_tls_file_that_is_a_fifo_or_a_device_is_refused_unread(tmp_path):
    """A FIFO nobody writes to held the render (and `up`) forever; /dev/zero read until memory ran out."""
    from hetlaunch.runtime.tls import TlsError, read_pem

    fifo = tmp_path / "agent.key"
    os.mkfifo(fifo)
    for key in (fifo, "/dev/zero"):
        with pytest.raises(DeployError, match=rf"^coordinator.tls.agent_key: cannot read {key} \(not a regular file\)$"):
            deploy(cluster_from_dict(_tls_cluster(tmp_path, key)), tmp_path / "k8s", None, "cluster.yaml")
        with pytest.raises(TlsError, match=rf"^coordinator.tls.key {key}: not a regular file$"):
            read_pem(key, "coordinator.tls.key")
    assert not (tmp_path / "k8s").exists() or not list((tmp_path / "k8s").iterdir())


def test_a_render_that_cannot_write_one_file_writes_none(tmp_path, monkeypatch):
    """A directory where a manifest goes: refused before anything is written, so no Secret is left
    holding a token that was saved nowhere."""
    monkeypatch.delenv("HETLAUNCH_TOKEN", raising=False)
    out = tmp_path / "k8s"
    (out / "group-a100.yaml").mkdir(parents=True)
    with pytest.raises(DeployError, match=r"group-a100.yaml is a directory"):
        deploy(cluster_from_dict(CLUSTER), out, None, "cluster.yaml")
    assert [p.name for p in out.iterdir()] == ["group-a100.yaml"]


def test_a_render_never_overwrites_its_own_cluster_yaml(tmp_path):
    out = tmp_path / "k8s"
    out.mkdir()
    source = write_cluster(out, name="secret.yaml")
    before = source.read_text()
    with pytest.raises(DeployError, match=r"would overwrite its own cluster YAML .*secret.yaml"):
        deploy(cluster_from_dict(CLUSTER), out, None, str(source))
    assert source.read_text() == before and [p.name for p in out.iterdir()] == ["secret.yaml"]


def test_a_newline_in_a_path_stays_inside_the_manifests_comment(tmp_path):
    """A cluster YAML named with a newline put a `kind:` line of its own into every manifest."""
    source = write_cluster(tmp_path, name="x\nkind: Evil\n#.yaml")
    deploy(cluster_from_dict(CLUSTER), tmp_path / "k8s", None, str(source))
    secret = (tmp_path / "k8s" / "secret.yaml").read_text()
    assert secret.splitlines()[0].startswith("# rendered by") and "x\\x0akind: Evil\\x0a#.yaml" in secret.splitlines()[0]
    assert [doc["kind"] for doc in yaml.safe_load_all(secret)] == ["Secret"]


def _yaml(**changes) -> str:
    data = copy.deepcopy(CLUSTER)
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is None:
            node.pop(int(last) if isinstance(node, list) else last)
        else:
            node[int(last) if isinstance(node, list) else last] = value
    return yaml.safe_dump(data)


@pytest.mark.parametrize("changes, expected", [
    ({"coordinator": {"host": "127.0.0.1", "port": 29400}}, "coordinator.host: 127.0.0.1 is loopback"),
    ({"coordinator__advertise": "localhost"}, "coordinator.advertise: localhost is loopback"),
    ({"coordinator__advertise": None}, "coordinator.advertise: required with kubernetes"),
    ({"coordinator__port": 0}, "coordinator.port: 0 (any free port)"),
    ({"kubernetes__groups__0__name": "A100_gpu"}, "kubernetes.groups[0].name"),
    ({"kubernetes__groups__0__name": "-a100"}, "kubernetes.groups[0].name"),
    ({"kubernetes__groups__0__name": "a" * 53}, "kubernetes.groups[0].name"),
    ({"kubernetes__groups__1__name": "a100"}, "kubernetes.groups[1].name: duplicate group 'a100'"),
    ({"kubernetes__groups__1__node_selector": {"bad key!": "x"}}, "kubernetes.groups[1].node_selector"),
    ({"kubernetes__groups__1__node_selector": {"nvidia.com/gpu.product": "x"}},
     "is set from the group's gpu_type"),
    ({"kubernetes__groups__1__gpu_type": "NVIDIA L4"}, "kubernetes.groups[1].gpu_type"),
    ({"kubernetes__groups__2__gpu_type": "NVIDIA-L4"}, "needs gpus_per_pod of at least 1"),
    ({"kubernetes__groups__1__region": "eu-west-"}, "kubernetes.groups[1].region: 'eu-west-' is no Kubernetes label"),
    ({"kubernetes__image": None}, "kubernetes.groups[0].image: required unless kubernetes.image"),
    ({"kubernetes__agent_args": ["--coordinator=1.2.3.4:5"]}, "--coordinator is set by the rendered command"),
    ({"kubernetes__agent_args": ["--insecure"]}, "--insecure is set by the rendered command"),
    ({"coordinator__host": "127.0.0.1", "coordinator__insecure": False},
     "coordinator.tls: required with kubernetes (pods dial the coordinator from other machines)"),
    ({"kubernetes__agent_args": ["--token_file", "/x"]}, "'--token_file' is not a flag of `hetlaunch agent`"),
    ({"kubernetes__groups": []}, "kubernetes.groups"),
    ({"kubernetes__groups__0__replicas": 0}, "kubernetes.groups[0].replicas"),
    ({"discover__regions": ["us-east"]}, "kubernetes.groups[1]: the agents of group l4 (l4-0, ...) could never join: "
                                         "they are in region eu-west and discover.regions takes us-east"),
    ({"discover__labels": {"pool": "k8s", "tier": "gold"}}, "discover.labels asks for tier=gold"),
    ({"discover__max_nodes": 3}, "discover.max_nodes: 3, but kubernetes.groups run 4 pods"),
    ({"discover": None, "nodes": [{"name": "x", "launch": "remote"}]}, "has no discover: section"),
])
def test_bad_kubernetes_sections_are_one_line(changes, expected):
    message = error_of(_yaml(**changes))
    assert message.startswith("cluster.yaml: ") and expected in message, message


def test_pods_listed_as_remote_nodes_join_without_discover(tmp_path):
    data = copy.deepcopy(CLUSTER)
    del data["discover"]
    data["kubernetes"]["groups"] = [{"name": "l4", "replicas": 2, "region": "eu-west", "gpu_type": "NVIDIA-L4"}]
    data["nodes"] = [{"name": f"l4-{k}", "launch": "remote", "region": "eu-west"} for k in range(2)]
    deploy(cluster_from_dict(data), tmp_path, None, "cluster.yaml")
    data["nodes"][1]["launch"] = "local"
    assert "pod l4-1 is also nodes entry 'l4-1' (launch: local" in error_of(yaml.safe_dump(data))


def test_the_cli_renders_and_refuses_in_one_line(tmp_path):
    path = write_cluster(tmp_path)
    token = tmp_path / "join-token"
    token.write_text(TOKEN)
    out = tmp_path / "k8s"
    out.mkdir()
    (out / "group-l4.yaml").write_text("stale")
    (out / "old-group.yaml").write_text("kind: Stale")
    done = run_hetlaunch("deploy", "k8s", str(path), "-o", str(out), "--token-file", str(token), timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"{out / 'group-l4.yaml'} (overwritten)" in done.stdout
    assert "also applies files this render did not write: old-group.yaml" in done.stdout
    assert f"next: kubectl apply -f {out} && hetlaunch up {path}" in done.stdout
    assert rendered(out)["group-l4.yaml"][1]["kind"] == "StatefulSet"
    assert (out / "old-group.yaml").read_text() == "kind: Stale"  # only files we render are replaced
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left behind

    bare = write_cluster(tmp_path, {k: v for k, v in CLUSTER.items() if k != "kubernetes"}, "bare.yaml")
    cases = [((str(bare), "-o", str(out)), "no kubernetes: section"),
             ((str(path), "-o", str(token)), f"-o {token}: is not a directory"),
             ((str(path), "-o", str(out), "--token-file", str(tmp_path / "none")), "does not exist")]
    for args, expected in cases:
        done = run_hetlaunch("deploy", "k8s", *args, timeout=60, env=hetlaunch_env(HETLAUNCH_TOKEN=""))
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr


def test_the_example_renders_with_its_certificates(tmp_path, monkeypatch):
    (tmp_path / "certs").mkdir()
    for name in ("ca.pem", "server.pem", "server.key", "agent.pem", "agent.key"):
        (tmp_path / "certs" / name).write_text(f"-----BEGIN X-----\n{name}\n-----END X-----\n")
    monkeypatch.chdir(tmp_path)  # the example's tls paths are relative, as `up` takes them
    cluster = load_cluster(REPO / "cluster_examples" / "kubernetes.yaml")
    deploy(cluster, tmp_path / "k8s", None, "kubernetes.yaml")
    docs = rendered(tmp_path / "k8s")
    for file in docs.values():
        for doc in file:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert sorted(docs["secret.yaml"][0]["stringData"]) == ["agent-cert.pem", "agent-key.pem", "ca.pem", "token"]
    assert sum(w["spec"]["replicas"] for w in workloads(docs).values()) == cluster.discover.max_nodes


def test_no_region_label_means_no_region_selector(tmp_path):
    data = copy.deepcopy(CLUSTER)
    data["kubernetes"]["region_label"] = None
    data["kubernetes"]["command"] = ["python", "-m", "hetlaunch.launcher.cli"]
    data["coordinator"]["advertise"] = "2001:db8::10"
    deploy(cluster_from_dict(data), tmp_path, None, "cluster.yaml")
    pods = {n: w["spec"]["template"]["spec"] for n, w in workloads(rendered(tmp_path)).items()}
    assert pods["a100"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert "nodeSelector" not in pods["cpu"]
    container = pods["cpu"]["containers"][0]
    assert container["command"] == ["python", "-m", "hetlaunch.launcher.cli"]
    assert container["args"][:4] == ["agent", "--serve", "--coordinator", "[2001:db8::10]:29400"]


def test_the_real_agent_command_takes_the_rendered_args(tmp_path, monkeypatch):
    """The container's args, as Kubernetes hands them over ($(POD_NAME) expanded, '$$' made '$', the
    Secret's files in place), parse as `hetlaunch agent` and reach the agent as the YAML said."""
    from typer.testing import CliRunner

    import hetlaunch.runtime.agent as agent_module
    from hetlaunch.launcher.cli import app

    deploy(cluster_from_dict(CLUSTER), tmp_path / "k8s", None, "cluster.yaml")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "token").write_text(TOKEN)
    args = workloads(rendered(tmp_path / "k8s"))["l4"]["spec"]["template"]["spec"]["containers"][0]["args"]
    args = [a.replace("$(POD_NAME)", "l4-1").replace("$$", "$").replace("/etc/hetlaunch", str(tmp_path / "secret"))
            for a in args]
    seen = {}
    monkeypatch.setattr(agent_module, "run_agent", lambda *a, **kw: seen.update(args=a, **kw) or 0)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen["args"][:3] == ("203.0.113.10:29400", "l4-1", TOKEN)
    assert (seen["serve"], seen["region"]) == (True, "eu-west")
    assert seen["labels"] == {"pool": "k8s", "cost": "$(HOME)"}
    assert seen["data_roots"] == ("/data",)


def test_a_new_secret_changes_the_pod_template_so_kubectl_apply_rolls_the_pods(tmp_path):
    """Agents read the Secret once, when they start: a token or certificate changed under running
    pods left them knocking with the old one. The template carries the Secret's revision."""
    def annotations(token: str, where: str) -> set[str]:
        token_file = tmp_path / f"{where}.token"
        token_file.write_text(token + "\n")
        deploy(cluster_from_dict(CLUSTER), tmp_path / where, token_file, "cluster.yaml")
        return {w["spec"]["template"]["metadata"]["annotations"]["hetlaunch/secret-revision"]
                for w in workloads(rendered(tmp_path / where)).values()}
    first = annotations(TOKEN, "a")
    assert len(first) == 1 and annotations(TOKEN, "a") == first  # rendered again, the same Secret: no roll
    assert annotations(TOKEN + "x", "a") != first  # a new token: the templates change, the pods roll
    # A random name, never derived from the token: a workload reader cannot test guesses against it.
    assert TOKEN not in str(first) and all(len(r) == 16 for r in first)


def test_the_flags_agent_args_may_set_are_the_agent_commands_own_but_those_rendered():
    """agent_args with a flag `hetlaunch agent` does not take (`--token_file`) rendered fine and
    crash-looped every pod; the lists stay in step with the command's options."""
    import typer.main

    from hetlaunch.launcher.cli import app
    from hetlaunch.launcher.providers.kubernetes import _OWN_FLAGS, AGENT_FLAGS

    command = typer.main.get_command(app).commands["agent"]
    flags = {opt for param in command.params for opt in param.opts if opt.startswith("--")}
    assert set(AGENT_FLAGS) | set(_OWN_FLAGS) == flags - {"--help"} and not set(AGENT_FLAGS) & set(_OWN_FLAGS)


# What kubectl's reader (go-yaml v2) takes for a number or a boolean when it stands plain.
_GO_YAML_NOT_STRING = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+|[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?"
                                 r"|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)|y|Y|n|N|yes|Yes|YES|no|No|NO|true|True|TRUE"
                                 r"|false|False|FALSE|on|On|ON|off|Off|OFF")


def test_strings_kubectls_reader_would_take_for_numbers_or_booleans_are_quoted(tmp_path):
    """kubectl reads with go-yaml: 1e3, 0o17, 0123... or y, left plain by PyYAML (YAML 1.1 reads
    them as strings), would be numbers or booleans where the manifests need strings (reviews)."""
    data = copy.deepcopy(CLUSTER)
    data["kubernetes"]["groups"][1].update(gpu_type="1e3", labels={"pool": "k8s", "cost": "0o17", "tier": "y"},
                                           node_selector={"zone": "0123", "spot": "n"})
    token_file = tmp_path / "numeric.token"
    token_file.write_text("0123456789012345678901234567\n")
    deploy(cluster_from_dict(data), tmp_path / "k8s", token_file, "cluster.yaml")
    plain_numbers = []
    for path in sorted((tmp_path / "k8s").glob("*.yaml")):
        for event in yaml.parse(path.read_text()):
            if isinstance(event, yaml.ScalarEvent) and event.style is None and _GO_YAML_NOT_STRING.fullmatch(event.value):
                plain_numbers.append(event.value)
    assert all(isinstance(yaml.safe_load(v), (int, float, bool)) for v in plain_numbers), plain_numbers  # real ones only
    l4 = workloads(rendered(tmp_path / "k8s"))["l4"]["spec"]["template"]["spec"]
    assert l4["nodeSelector"]["zone"] == "0123" and l4["nodeSelector"]["nvidia.com/gpu.product"] == "1e3"
    assert "cost=0o17" in l4["containers"][0]["args"] and l4["nodeSelector"]["spot"] == "n"
    secret = yaml.safe_load((tmp_path / "k8s" / "secret.yaml").read_text())
    assert secret["stringData"]["token"] == "0123456789012345678901234567"


def test_a_line_separator_in_the_output_path_stays_inside_the_manifests_comment(tmp_path):
    """YAML breaks lines at U+2028 and U+2029: in -o's path they ended the header comment and what
    followed became a key of every manifest (`immutable: true` on the Secret, a hostile review)."""
    out = tmp_path / "k8s\u2028immutable: true\u2029#"
    deploy(cluster_from_dict(CLUSTER), out, None, "cluster.yaml")
    for path in out.glob("*.yaml"):
        text = path.read_text()
        assert "\u2028" not in text and "\u2029" not in text and "k8s\\u2028immutable: true\\u2029#" in text
        assert all("immutable" not in doc for doc in yaml.safe_load_all(text))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["fifo", "zeros", "deep"])
def test_a_hostile_secret_yaml_where_the_render_goes_is_taken_for_none_of_ours(tmp_path, planted):
    """The render reads the Secret it wrote before (to keep its revision): a FIFO there hung it,
    /dev/zero grew it without end, a deeply nested file ended in a traceback."""
    out = tmp_path / "k8s"
    out.mkdir()
    secret = out / "secret.yaml"
    if planted == "fifo":
        os.mkfifo(secret)
    elif planted == "zeros":
        secret.symlink_to("/dev/zero")
    else:
        secret.write_text("[" * 5000 + "]" * 5000)
    deploy(cluster_from_dict(CLUSTER), out, None, "cluster.yaml")
    assert stat.S_ISREG(secret.lstat().st_mode)  # replaced by the render's own, whole
    assert [doc["kind"] for doc in yaml.safe_load_all(secret.read_text())] == ["Secret"]
