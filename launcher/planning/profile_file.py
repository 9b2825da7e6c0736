"""The profile: what the planner knows about a cluster, and the only thing it reads.

A profile is a JSON file (format `hetlaunch-profile/1`) that `hetlaunch profile` writes and
`hetlaunch plan --profile` reads; a user can also write one by hand for a cluster they do
not have yet. The schema is enforced on load (unknown keys, wrong types and inconsistent
lengths are errors). All times are seconds for one micro-batch of `micro_batch_size`
sequences of `seq_len` tokens.

    {
      "format": "hetlaunch-profile/1",
      "model": {"description": "gpt(...)", "num_layers": 6},
      "micro_batch_size": 8, "seq_len": 64,
      "layers": [{"param_bytes": 49152, "activation_bytes": 4608, "output_bytes": 131072}, ...],
      "nodes": [{"name": "a", "region": "us-east", "device": "NVIDIA L4", "memory_bytes": 2.4e10,
                 "layer_seconds": [...], "optimizer_seconds": [...],
                 "codec_seconds_per_byte": {"int8": 1e-9, ...},
                 "layer_seconds_by_size": {"4": [...]}}, ...],
      "links": [{"nodes": ["a", "b"], "bandwidth_bytes_per_s": 1.2e9, "latency_s": 0.0002},
                {"regions": ["us-east", "eu-west"], "bandwidth_bytes_per_s": 6.25e6, "latency_s": 0.04}]
    }

`layers[i].output_bytes` is what crosses a stage boundary placed after layer i (the same
size flows back as a gradient); `activation_bytes` is what a stage keeps per micro-batch
in flight; `param_bytes` is multiplied by STATIC_BYTES_PER_PARAM_BYTE (4: parameters, gradients
and AdamW's two moments; runtime/registry.py).
A link between two nodes is looked up by node pair first, then by their region pair
(`["r", "r"]` for inside a region).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from hetlaunch.runtime.files import UnreadableFile, read_json, write_whole
from hetlaunch.runtime.registry import CODEC_NAMES

FORMAT = "hetlaunch-profile/1"


class ProfileError(Exception):
    """One-line reason a profile cannot be used."""


MAX_PROFILE_BYTES = 64 << 20  # ~100 bytes a layer and a node: a bigger file is not a profile
MAX_SECONDS = 86_400.0  # one layer, one micro-batch: over a day is no timing
# ... and under a nanosecond neither: 5e-324 s layers (above zero) made a step 0 s or too small to
# divide by, and plans crashed or said "inf tokens/s" (a hostile review).
MIN_SECONDS = 1e-9
MAX_BYTES = 1 << 53  # byte counts stay exact as floats (8 PiB)
MIN_BANDWIDTH = 1.0  # bytes/s of a link
# The YAML's own bounds (launcher/config_types.py MAX_COUNT, MAX_MODEL_DIM; the planner imports no config).
MAX_MICRO_BATCH = 1 << 20
MAX_SEQ_LEN = 1 << 24



def _json_number(value: object) -> object:
    """A number as JSON writes one: pydantic's lax mode took "0.1" and true as seconds, which no
    measurement writes and a hand-edited file may mean as something else."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"must be a JSON number, not {type(value).__name__} {value!r:.40}")
    return value


Number = BeforeValidator(_json_number)
# What every measured number must be, in a profile file and in the profile cache alike: a
# negative, zero or NaN time would price a plan at "-103 tokens/s" or divide by zero.
Seconds = Annotated[float, Number, Field(ge=MIN_SECONDS, le=MAX_SECONDS)]
MaybeZeroSeconds = Annotated[float, Number, Field(ge=0, le=MAX_SECONDS)]
ByteCount = Annotated[int, Number, Field(ge=0, le=MAX_BYTES)]
Count = Annotated[int, Number]
Real = Annotated[float, Number]


def _size_keys(value: object) -> object:
    """layer_seconds_by_size's keys as JSON writes a micro-batch size: digits ("2.0" and " 2" were
    taken as 2, and 10**400 crashed the global-batch planner; a hostile review)."""
    if isinstance(value, dict):
        for key in value:
            if not (isinstance(key, int) and not isinstance(key, bool)
                    or isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 8):
                raise ValueError(f"a micro-batch size must be written as digits, not {key!r:.40}")
    return value


MicroBatchSize = Annotated[int, Field(ge=1, le=MAX_MICRO_BATCH)]


def _codec_name(name: str) -> str:
    if name not in CODEC_NAMES:
        raise ValueError(f"{name!r:.40} is not a codec (known: {', '.join(CODEC_NAMES)})")
    return name


CodecName = Annotated[str, AfterValidator(_codec_name)]


# Node and region names as the cluster YAML allows them: they are printed in tables and messages,
# so no control character, newline or empty name gets there from a hand-written profile.
NodeName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class _Strict(BaseModel):
    # allow_inf_nan: 1e400 parses as inf; neither it nor NaN is a measurement.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelIdentity(_Strict):
    description: str
    num_layers: Count = Field(ge=1)


class LayerInfo(_Strict):
    param_bytes: ByteCount
    activation_bytes: ByteCount
    output_bytes: ByteCount


class NodeProfile(_Strict):
    name: NodeName
    region: NodeName = "default"
    device: str
    memory_bytes: Real = Field(gt=0, le=MAX_BYTES)
    layer_seconds: list[Seconds]
    optimizer_seconds: list[MaybeZeroSeconds] | None = None  # per layer, one AdamW step; default 0
    # Per layer, the backward split as zero-bubble schedules run it: the input's gradient (with the
    # graph's analysis) and the weights'. None: not measured (the planner halves the backward).
    input_grad_seconds: list[MaybeZeroSeconds] | None = None
    weight_grad_seconds: list[MaybeZeroSeconds] | None = None
    # encode + decode per raw byte; default 0 (a name no codec has was ignored: "int-8" left int8 priced free)
    codec_seconds_per_byte: dict[CodecName, MaybeZeroSeconds] | None = None
    # layer_seconds measured at other micro-batch sizes (a global batch lets the planner choose the
    # size; launcher/planning/batch_sizes.py interpolates between these and reports its error)
    layer_seconds_by_size: Annotated[dict[MicroBatchSize, list[Seconds]] | None, BeforeValidator(_size_keys)] = None
    # Where it runs: nodes with one host share its cores (launcher/planning/contention.py).
    host: str | None = Field(None, max_length=255)
    host_cores: Count | None = Field(None, ge=1, le=1_000_000)
    cpu_per_wall: Real | None = Field(None, ge=0, le=1_000_000)  # cores busy while it computes, measured alone
    # AES-256-GCM seal + open of a sealed message, per byte (data_plane.encrypt); None: not measured (priced 0)
    cipher_seconds_per_byte: MaybeZeroSeconds | None = None

    def optimizer(self, index: int) -> float:
        return self.optimizer_seconds[index] if self.optimizer_seconds else 0.0

    def codec_cost(self, codec: str) -> float:
        return (self.codec_seconds_per_byte or {}).get(codec, 0.0)


class LinkProfile(_Strict):
    nodes: tuple[str, str] | None = None
    regions: tuple[str, str] | None = None
    # At least a byte a second: 1e-300 priced a step at a 300-digit number of ms, 5e-324 at inf.
    bandwidth_bytes_per_s: Real = Field(ge=MIN_BANDWIDTH)
    latency_s: MaybeZeroSeconds

    @model_validator(mode="after")
    def _one_scope(self) -> "LinkProfile":
        if (self.nodes is None) == (self.regions is None):
            raise ValueError("a link names exactly one of `nodes` or `regions`")
        return self


def with_encryption(profile: "Profile", encrypt: str) -> "Profile":
    """A copy of `profile` whose plans price data_plane.encrypt `encrypt` (the cost model seals by it)."""
    return profile if profile.data_plane_encrypt == encrypt else profile.model_copy(update={"data_plane_encrypt": encrypt})


class Profile(_Strict):
    format: Literal["hetlaunch-profile/1"] = FORMAT
    model: ModelIdentity
    micro_batch_size: Count = Field(ge=1, le=MAX_MICRO_BATCH)  # 2**62 predicted 6e22 tokens/s
    seq_len: Count = Field(ge=1, le=MAX_SEQ_LEN)
    # What a job keeps per parameter byte beyond STATIC_BYTES_PER_PARAM_BYTE (islands: the anchor,
    # the outer momentum, error feedback, the exchange's buffers; launcher/planning/island_plans.py).
    # Set by the planner on its own copy; a measured profile has none (None: 0, never written).
    static_extra_per_param_byte: Real | None = Field(None, ge=0, le=64)
    # The job's data_plane.encrypt, set by the planner's caller on its own copy (launcher/adapt/replanner.py):
    # the cost model adds each node's cipher to what it seals. None: nothing sealed.
    data_plane_encrypt: Literal["off", "cross_region", "all"] | None = None
    layers: list[LayerInfo]
    nodes: list[NodeProfile] = Field(min_length=1)
    links: list[LinkProfile] = []

    @model_validator(mode="after")
    def _consistent(self) -> "Profile":
        n = self.model.num_layers
        if len(self.layers) != n:
            raise ValueError(f"layers has {len(self.layers)} entries for a model of {n} layers")
        names = [node.name for node in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        for node in self.nodes:
            if len(node.layer_seconds) != n:
                raise ValueError(f"node {node.name}: layer_seconds has {len(node.layer_seconds)} entries, expected {n}")
            for size, seconds in (node.layer_seconds_by_size or {}).items():
                if size < 1 or size == self.micro_batch_size or len(seconds) != n:
                    raise ValueError(f"node {node.name}: layer_seconds_by_size[{size}] must be another micro-batch "
                                     f"size >= 1 with {n} entries")
            for name in ("optimizer_seconds", "input_grad_seconds", "weight_grad_seconds"):
                values = getattr(node, name)
                if values is not None and len(values) != n:
                    raise ValueError(f"node {node.name}: {name} has {len(values)} entries, expected {n}")
        for link in self.links:
            if link.nodes is not None and not set(link.nodes) <= set(names):
                raise ValueError(f"link {list(link.nodes)} names a node not in the profile")
        return self

    def node(self, name: str) -> NodeProfile:
        return next(n for n in self.nodes if n.name == name)

    def link(self, a: NodeProfile, b: NodeProfile) -> LinkProfile:
        """The measured link between two nodes: by node pair, else by region pair (the first of
        each the file lists). Looked up in an index of the links (a scan of every link per call was
        a third of planning 40 one-node regions: 820 links, and a region path prices every pair),
        made again whenever the links are not the ones it was made of: another list, or this one
        changed since (a _Links counts its changes; comparing every link's id on every call made a
        lookup cost as much as a scan at 20,100 links, a hostile review)."""
        links = self.links
        if type(links) is not _Links:  # as validated or copied in: counted from here on
            links = self.__dict__["links"] = _Links(links)
        stamp = (id(links), links.changes)  # the index holds the list: its id is not reused meanwhile
        index = _LINK_INDEXES.get(id(self))
        if index is None or index[0] != stamp:
            if index is None:  # kept beside the profile, not in it: pydantic's == compares what is in it
                weakref.finalize(self, _LINK_INDEXES.pop, id(self), None)
            by_nodes: dict[frozenset, LinkProfile] = {}
            by_regions: dict[tuple, LinkProfile] = {}
            for link in links:
                if link.nodes is not None:
                    by_nodes.setdefault(frozenset(link.nodes), link)
                if link.regions is not None:
                    by_regions.setdefault(tuple(sorted(link.regions)), link)
            index = _LINK_INDEXES[id(self)] = (stamp, by_nodes, by_regions, links)
        found = index[1].get(frozenset((a.name, b.name)))
        if found is None:
            found = index[2].get(tuple(sorted((a.region, b.region))))
        if found is not None:
            return found
        raise ProfileError(f"profile has no link between {a.name} ({a.region}) and {b.name} ({b.region}); "
                           f"add a links entry for nodes [{a.name}, {b.name}] or regions [{a.region}, {b.region}]")

    def check_model(self, description: str, num_layers: int, micro_batch_size: int) -> None:
        if (self.model.description, self.model.num_layers) != (description, num_layers):
            raise ProfileError(f"the profile was measured for model {self.model.description} "
                               f"({self.model.num_layers} layers), not {description} ({num_layers} layers)")
        if self.micro_batch_size != micro_batch_size:
            raise ProfileError(f"the profile was measured at micro-batch size {self.micro_batch_size}, "
                               f"not {micro_batch_size}")


# Profile.link's indexes, by the profile's id: ((the id of the list indexed, its count of changes), by
# node pair, by region pair, the list); each removed when its profile is collected.
_LINK_INDEXES: dict[int, tuple] = {}


class _Links(list):
    """A profile's links, counting every change made to the list in place (Profile.link's index
    is made again after one); equal to the plain list it holds."""

    changes = 0

    def _changed(method):
        def counted(self, *args, **kwargs):
            self.changes += 1
            return method(self, *args, **kwargs)
        counted.__name__ = method.__name__
        return counted

    for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop",
                  "remove", "clear", "sort", "reverse"):
        locals()[_name] = _changed(getattr(list, _name))
    del _name, _changed


def load_profile(path: str | Path) -> Profile:
    try:
        data = read_json(Path(path), MAX_PROFILE_BYTES)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except UnreadableFile as err:
        raise ProfileError(f"{path}: {err}") from None
    try:
        profile = Profile.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise ProfileError(f"{path}: {where}: {first['msg']}{more}") from None
    problem = link_problem(profile)
    if problem:
        raise ProfileError(f"{path}: {problem}")
    return profile


def link_problem(profile: Profile) -> str | None:
    """What makes a file's links ambiguous or a likely typo, or None: a link from a node to
    itself, a region no node is in, or one pair given twice (the planner read the first and
    silently ignored the other). Checked where a file is loaded, not on every Profile: the
    planner's copies without lost nodes keep the links of regions those nodes left."""
    regions = {n.region for n in profile.nodes}
    seen: dict[tuple, int] = {}
    for i, link in enumerate(profile.links):
        if link.nodes is not None:
            if link.nodes[0] == link.nodes[1]:
                return f"links.{i}: joins node {link.nodes[0]} to itself (a region's own links are regions [r, r])"
            pair = ("nodes", *sorted(link.nodes))
        else:
            unknown = sorted(set(link.regions) - regions)
            if unknown:
                return f"links.{i}: no node is in region {unknown[0]}"
            pair = ("regions", *sorted(link.regions))
        if pair in seen:
            return f"links.{i}: {pair[0]} {list(pair[1:])} are given twice (also links.{seen[pair]})"
        seen[pair] = i
    return None


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write whole or not at all (temporary file, fsync, rename); ProfileError naming the path."""
    try:
        write_whole(Path(path), profile.model_dump_json(indent=2, exclude_none=True) + "\n")
    except OSError as err:
        raise ProfileError(f"cannot write {path}: {err.strerror or err}") from None
