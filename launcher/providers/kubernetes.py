"""Kubernetes: the YAML's `kubernetes:` section and the manifests `hetlaunch deploy k8s` renders from it
(written into a directory by launcher/providers/kubernetes_deploy.py).

hetlaunch does not talk to a Kubernetes API. It writes what runs the agents there, for `kubectl apply -f
DIR`: a Secret with the join token (and, under coordinator.tls, the certificates an agent needs), and per
node group a headless Service and a StatefulSet whose pods run `hetlaunch agent --serve`. The pods dial
the coordinator `hetlaunch up` starts and join through the YAML's `discover:` (or as listed remote nodes).

A StatefulSet, not a Deployment: its pods have stable names (GROUP-0, GROUP-1, ...), which become the
agents' node names, so a pod that Kubernetes restarts rejoins as the node it was (a lost discovered
node may rejoin under its name) and cached profiles keep their owner. Pods start in parallel (no pod
waits for another to be ready). The token and certificates reach the agent as files of the mounted
Secret, never as an argument or an environment variable's value. No probes: `agent --serve` keeps
dialing the coordinator until it is stopped, and a container whose agent exits is restarted.

Names follow Kubernetes' rules, checked here so that a name the API would refuse fails as one line
of the cluster YAML: a group name is an RFC 1035 label of at most 52 characters (the StatefulSet
controller adds an 11-character revision hash to it in a label of at most 63).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StringConstraints, field_validator, model_validator

from hetlaunch.launcher.config_errors import FieldError
from hetlaunch.launcher.config_types import Name, Strict, is_loopback
from hetlaunch.runtime.labels import LABEL_KEY, MAX_LABEL_VALUE

_K8S_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


def _matching(pattern: str, max_length: int, what: str):
    """A string type checked against one of Kubernetes' name rules, refused in the user's words."""
    def check(value: str) -> str:
        if len(value) > max_length or not re.fullmatch(pattern, value):
            raise ValueError(f"must be {what}, at most {max_length} characters (got {value[:80]!r})")
        return value
    return Annotated[str, AfterValidator(check)]


GroupName = _matching(r"[a-z]([-a-z0-9]*[a-z0-9])?", 52, "lowercase letters, digits and '-', starting with a "
                                                         "letter and ending with a letter or digit (RFC 1035)")
ObjectName = _matching(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", 63, "lowercase letters, digits and '-', starting and "
                                                             "ending with a letter or digit (RFC 1123)")
# A Kubernetes label key: an optional DNS-subdomain prefix and '/', then a name of at most 63.
K8sLabelKey = _matching(rf"({_DNS_SUBDOMAIN}/)?{_K8S_NAME}", 253 + 1 + 63, "a Kubernetes label key: [PREFIX/]NAME, "
                        "NAME of letters, digits, '-', '_', '.' starting and ending with a letter or digit")
_K8S_VALUE = re.compile(rf"({_K8S_NAME})?")
K8sLabelValue = _matching(_K8S_VALUE.pattern, 63, "a Kubernetes label value: letters, digits, '-', '_', '.', "
                          "starting and ending with a letter or digit")
Image = Annotated[str, StringConstraints(pattern=r"^[^\s$]+$", max_length=512)]

SECRET_DIR = "/etc/hetlaunch"  # where the Secret's files appear in the agent container
TOKEN_KEY, CA_KEY, CERT_KEY, KEY_KEY = "token", "ca.pem", "agent-cert.pem", "agent-key.pem"
GPU_RESOURCE = "nvidia.com/gpu"
REVISION = "hetlaunch/secret-revision"
MAX_SECRET_BYTES = 4 << 20  # a Secret holds at most 1 MiB of data; a secret.yaml far above is none of ours
# Flags the rendered command sets itself: agent_args may not set them again.
_OWN_FLAGS = ("--coordinator", "--name", "--token-file", "--serve", "--region", "--label", "--ca", "--cert", "--key",
              "--insecure")
# ... and those it may add (`hetlaunch agent`'s others): anything else would crash-loop every pod.
AGENT_FLAGS = ("--work-dir", "--allow-entrypoint", "--data-root", "--checkpoint-root", "--connect-timeout")


class KubeGroup(Strict):
    name: GroupName  # the StatefulSet; its pods, NAME-0 .. NAME-(replicas-1), are the agents' node names
    replicas: int = Field(1, ge=1, le=1000)  # pods, one agent each
    region: Name  # the agents' --region, and the pods' nodeSelector on kubernetes.region_label
    gpu_type: K8sLabelValue | None = None  # nodeSelector on kubernetes.gpu_label, e.g. NVIDIA-A100-SXM4-80GB
    gpus_per_pod: int = Field(1, ge=0, le=64)  # resources.limits nvidia.com/gpu; 0: a CPU-only group
    image: Image | None = None  # default: kubernetes.image
    # the agents' discovery labels (--label KEY=VALUE), what discover.labels matches
    labels: dict[Annotated[str, StringConstraints(pattern=LABEL_KEY)],
                 Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE)]] = Field(default_factory=dict)
    node_selector: dict[K8sLabelKey, K8sLabelValue] = Field(default_factory=dict)  # more nodeSelector terms

    @model_validator(mode="after")
    def _gpu(self) -> KubeGroup:
        if self.gpu_type is not None and self.gpus_per_pod == 0:
            raise FieldError(("gpu_type",), "needs gpus_per_pod of at least 1 (a pod that selects a GPU node "
                                            "should use its GPU)")
        return self


class KubernetesConfig(Strict):
    image: Image | None = None  # the container image every group uses unless it sets its own (hetlaunch installed)
    command: list[Annotated[str, StringConstraints(min_length=1)]] = Field(["hetlaunch"], min_length=1)  # runs the CLI
    secret: ObjectName = "hetlaunch-agent"  # the Secret's name
    region_label: K8sLabelKey | None = "topology.kubernetes.io/region"  # node label matched to a group's region
    gpu_label: K8sLabelKey | None = "nvidia.com/gpu.product"  # node label matched to a group's gpu_type
    agent_args: list[str] = Field(default_factory=list)  # more `hetlaunch agent` flags, e.g. [--data-root, /data]
    groups: list[KubeGroup] = Field(min_length=1)

    @field_validator("agent_args")
    @classmethod
    def _not_ours(cls, value: list[str]) -> list[str]:
        for arg in value:
            flag = arg.split("=", 1)[0]
            if flag in _OWN_FLAGS:
                raise ValueError(f"{flag} is set by the rendered command itself (got {arg[:80]!r})")
            if flag.startswith("-") and flag not in AGENT_FLAGS:
                raise ValueError(f"{flag[:80]!r} is not a flag of `hetlaunch agent` that agent_args may set "
                                 f"(one of {', '.join(AGENT_FLAGS)})")
        return value

    @model_validator(mode="after")
    def _groups(self) -> KubernetesConfig:
        seen: dict[str, int] = {}
        for i, group in enumerate(self.groups):
            if group.name in seen:
                raise FieldError(("groups", i, "name"), f"duplicate group {group.name!r} (also groups[{seen[group.name]}])")
            seen[group.name] = i
            if group.image is None and self.image is None:
                raise FieldError(("groups", i, "image"), "required unless kubernetes.image is set (an image with "
                                                         "hetlaunch installed)")
            for key, own in ((self.region_label, "region"), (self.gpu_label if group.gpu_type else None, "gpu_type")):
                if key is not None and key in group.node_selector:
                    raise FieldError(("groups", i, "node_selector", key), f"is set from the group's {own}")
            if group.gpu_type is not None and self.gpu_label is None:
                raise FieldError(("groups", i, "gpu_type"), "needs kubernetes.gpu_label (the node label to match)")
            if self.region_label is not None and not _K8S_VALUE.fullmatch(group.region):
                raise FieldError(("groups", i, "region"), f"{group.region!r} is no Kubernetes label value for the "
                                                          f"nodeSelector on {self.region_label} (at most 63, ending "
                                                          "with a letter or digit); or set region_label: null")
        return self

    def agents(self) -> list[tuple[int, KubeGroup, str]]:
        """(group index, group, node name) of every pod, in order."""
        return [(i, g, f"{g.name}-{k}") for i, g in enumerate(self.groups) for k in range(g.replicas)]


def coordinator_address(cluster) -> str:
    """HOST:PORT the pods dial (cluster's coordinator.advertise, else its host)."""
    coordinator = cluster.coordinator
    host = coordinator.advertise or coordinator.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{coordinator.port}"


def check_cluster(cluster) -> None:
    """What a kubernetes: section needs of the rest of the YAML, as FieldErrors (called by
    ClusterConfig's validation, so `validate` and `up` say it too): a coordinator the pods can reach
    and a way for every pod's agent to join."""
    kube, coordinator = cluster.kubernetes, cluster.coordinator
    host = coordinator.advertise or coordinator.host
    field = "advertise" if coordinator.advertise else "host"
    if host in ("0.0.0.0", "::", "[::]"):
        raise FieldError(("coordinator", "advertise"), f"required with kubernetes: coordinator.host {host} is no "
                                                       "address a pod can dial; set the one pods reach it at")
    if is_loopback(host):
        raise FieldError(("coordinator", field), f"{host} is loopback: pods could never reach it; set "
                                                 "coordinator.advertise to an address they reach (and host to bind)")
    if coordinator.port == 0:
        raise FieldError(("coordinator", "port"), "0 (any free port) cannot be written into the pods' --coordinator: "
                                                  "set a fixed port")
    tls = coordinator.tls
    if tls is None and not coordinator.insecure:  # the pods dial another machine: clear text only as said
        raise FieldError(("coordinator", "tls"), "required with kubernetes (pods dial the coordinator from other "
                                                 "machines), or insecure: true on a network you trust")
    if tls is not None and tls.ca is not None and tls.agent_cert is None:
        raise FieldError(("coordinator", "tls", "agent_cert"), "required with tls.ca and kubernetes: under mutual "
                                                               "TLS the pods' agents present it")
    listed = {n.name: n for n in cluster.nodes}
    strangers = 0
    for i, group, name in kube.agents():
        node = listed.get(name)
        if node is not None:
            if node.launch != "remote" or node.region != group.region:
                raise FieldError(("kubernetes", "groups", i, "name"), f"pod {name} is also nodes entry {name!r} "
                                 f"(launch: {node.launch}, region {node.region}): list it as launch: remote in "
                                 f"region {group.region}, or rename the group")
            continue
        strangers += 1
        why = _refusal(cluster.discover, group)
        if why:
            raise FieldError(("kubernetes", "groups", i), f"the agents of group {group.name} ({name}, ...) could "
                                                          f"never join: {why}")
    limit = cluster.discover.max_nodes if cluster.discover is not None else None
    if limit is not None and strangers > limit:
        raise FieldError(("discover", "max_nodes"), f"{limit}, but kubernetes.groups run {strangers} pods that join "
                                                    "by discovery: the rest would be refused")


def _refusal(rule, group: KubeGroup) -> str | None:
    """Why discover: would turn away every agent of this group, or None (launcher/discovery.py's rule)."""
    if rule is None:
        return "the YAML has no discover: section and does not list them as nodes"
    if rule.regions and group.region not in rule.regions:
        return f"they are in region {group.region} and discover.regions takes {', '.join(rule.regions)}"
    for key, value in sorted(rule.labels.items()):
        if group.labels.get(key) != value:
            return f"discover.labels asks for {key}={value} and the group's labels do not have it"
    return None


def render(cluster, token: str, tls_files: dict[str, str], revision: str = "") -> dict[str, list[dict[str, Any]]]:
    """File name -> the Kubernetes objects in it: secret.yaml, then group-NAME.yaml per node group.
    `tls_files`: Secret key (CA_KEY, CERT_KEY, KEY_KEY) -> PEM text, as read_tls_files returns.
    `revision`: names this Secret's content on the Secret and every pod template (secret_revision)."""
    kube = cluster.kubernetes
    meta_labels = {"app.kubernetes.io/name": "hetlaunch-agent", "app.kubernetes.io/part-of": "hetlaunch"}
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": kube.secret, "labels": dict(meta_labels)},
              "stringData": {TOKEN_KEY: token, **tls_files}}
    files: dict[str, list[dict[str, Any]]] = {"secret.yaml": [secret]}
    # The agents read the Secret when they start: a pod template that names its revision changes
    # with it, so `kubectl apply` rolls the pods onto a new token (else they kept knocking with the
    # old one). A random name, not a digest: whoever may read workloads but not Secrets could test
    # guesses of a weak token against a digest.
    secret["metadata"]["annotations"] = {REVISION: revision}
    for group in kube.groups:
        labels = {**meta_labels, "hetlaunch/group": group.name}
        service = {"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": group.name, "labels": labels},
                   "spec": {"clusterIP": "None", "selector": dict(labels)}}  # headless: pod DNS names only
        stateful = {"apiVersion": "apps/v1", "kind": "StatefulSet",
                    "metadata": {"name": group.name, "labels": labels},
                    "spec": {"serviceName": group.name, "replicas": group.replicas,
                             "podManagementPolicy": "Parallel",
                             "selector": {"matchLabels": dict(labels)},
                             "template": {"metadata": {"labels": dict(labels),
                                                       "annotations": {REVISION: revision}},
                                          "spec": _pod(cluster, group)}}}
        files[f"group-{group.name}.yaml"] = [service, stateful]
    return files


def _pod(cluster, group: KubeGroup) -> dict[str, Any]:
    kube = cluster.kubernetes
    selector = dict(group.node_selector)
    if kube.region_label is not None:
        selector[kube.region_label] = group.region
    if group.gpu_type is not None:
        selector[kube.gpu_label] = group.gpu_type
    container: dict[str, Any] = {
        "name": "agent", "image": group.image or kube.image, "command": [own(c) for c in kube.command],
        "args": agent_args(cluster, group),
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "volumeMounts": [{"name": "hetlaunch-secret", "mountPath": SECRET_DIR, "readOnly": True}]}
    if group.gpus_per_pod:
        container["resources"] = {"limits": {GPU_RESOURCE: group.gpus_per_pod}}
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the agent never calls the Kubernetes API
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": [{"name": "hetlaunch-secret", "secret": {"secretName": kube.secret, "defaultMode": 0o400}}]}
    if selector:
        pod["nodeSelector"] = selector
    if group.gpus_per_pod:  # GPU nodes are often tainted so that only pods asking for GPUs land there
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return pod


def own(value: str) -> str:
    """A value of the YAML in a container's command or args: Kubernetes expands $(VAR) there, so
    every '$' is doubled and only our own $(POD_NAME) expands."""
    return value.replace("$", "$$")


def agent_args(cluster, group: KubeGroup) -> list[str]:
    """`hetlaunch agent` and its flags, as the container's args."""
    kube, tls = cluster.kubernetes, cluster.coordinator.tls
    args = ["agent", "--serve", "--coordinator", own(coordinator_address(cluster)), "--name", "$(POD_NAME)",
            "--token-file", f"{SECRET_DIR}/{TOKEN_KEY}", "--region", own(group.region)]
    for key, value in sorted(group.labels.items()):
        args += ["--label", own(f"{key}={value}")]
    if tls is not None:
        args += ["--ca", f"{SECRET_DIR}/{CA_KEY}"]
        if tls.ca is not None:
            args += ["--cert", f"{SECRET_DIR}/{CERT_KEY}", "--key", f"{SECRET_DIR}/{KEY_KEY}"]
    else:  # clear text to another machine, as coordinator.insecure says (check_cluster requires it)
        args.append("--insecure")
    if cluster.model.entrypoint is not None:  # the agents run this job's model, and only it
        args.append(own(f"--allow-entrypoint={cluster.model.entrypoint}"))
    return args + [own(a) for a in kube.agent_args]


def tls_sources(cluster) -> dict[str, tuple[str, str]]:
    """Secret key -> (YAML field, file) of what the agents need under coordinator.tls: the CA that
    signed the coordinator's certificate (or that certificate), and under mutual TLS their own pair."""
    tls = cluster.coordinator.tls
    if tls is None:
        return {}
    sources = {CA_KEY: ("coordinator.tls.ca", tls.ca) if tls.ca else ("coordinator.tls.cert", tls.cert)}
    if tls.ca is not None:
        sources[CERT_KEY] = ("coordinator.tls.agent_cert", tls.agent_cert)
        sources[KEY_KEY] = ("coordinator.tls.agent_key", tls.agent_key)
    return sources
