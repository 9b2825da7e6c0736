"""Reading a cluster YAML file: refuse hostile input before it costs time or memory, then
validate it against the schema (launcher/cluster_config.py); every problem is one ConfigError line.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import ValidationError

from hetlaunch.launcher.cluster_config import ClusterConfig
from hetlaunch.launcher.config_types import ConfigError
from hetlaunch.launcher.config_errors import describe, one_line, show, yaml_path

MAX_FILE_BYTES = 1 << 20  # a cluster YAML is a few KB; refuse to read (or parse) more than 1 MiB
MAX_DEPTH = 64  # nesting levels of YAML lists and mappings (the schema needs 4)
MAX_NODES = 50_000  # YAML keys and values (a cluster file has a few hundred)

def load_cluster(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster YAML file; every problem is a one-line ConfigError."""
    source = str(path)
    try:
        # O_NONBLOCK: a FIFO nobody writes to opens at once (and reads as empty) instead of hanging;
        # blocking again for the reads, so `validate <(generate-yaml)` still waits for its writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise IsADirectoryError()
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE_BYTES:  # refuse before reading a byte of it
                raise ConfigError(_too_big(source, size))
            raw = f.read(MAX_FILE_BYTES + 1)  # a pipe or device reports no size: read one byte past the cap at most
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, not a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(_too_big(source, None))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    return parse_cluster(text, source)


def parse_cluster(text: str, source: str = "<string>") -> ClusterConfig:
    """Validate cluster YAML given as text; ``source`` prefixes every message.

    Hostile input is refused before it can cost time or memory: more than 1 MiB, anchors and
    aliases (a few hundred bytes of them expand to billions of nodes), nesting deeper than 64
    levels, more than 50,000 keys and values. A ``data.path`` must name a readable, non-empty
    regular file (a relative one is taken from the current directory, as ``hetlaunch up`` does)."""
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(_too_big(source, len(text.encode("utf-8", "surrogatepass"))))
    try:
        data = _load_yaml(text, source)
        if data is None:
            raise ConfigError(f"{source}: file is empty (a cluster needs at least `nodes:`)")
        cluster = cluster_from_dict(data, source)
    except RecursionError:  # a last resort: the depth cap should make this unreachable
        raise ConfigError(f"{source}: nested too deeply to read") from None
    _check_data_path(cluster, source)
    return cluster


def cluster_from_dict(data: Any, source: str = "<dict>") -> ClusterConfig:
    """Validate an already-parsed mapping (for code and tests that build configs).

    Unlike :func:`parse_cluster` it does not look at the file system: ``data.path`` is not checked."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: top level must be a mapping of sections (got {show(data)})")
    try:
        return ClusterConfig.model_validate(dict(data))
    except ValidationError as exc:
        errors = exc.errors()
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"{source}: {describe(_first_to_say(errors), ClusterConfig)}{more}") from None


def _first_to_say(errors: list[dict]) -> dict:
    """The error to show of several: the first, unless it is a required key missing beside an
    unknown key in the same mapping, most likely its misspelling, which is then said instead with
    its suggestion (`nodes: [{nme: a}]` said only that `name` was required)."""
    first = errors[0]
    if first["type"] == "missing":
        for err in errors[1:]:
            if err["type"] == "extra_forbidden" and tuple(err["loc"][:-1]) == tuple(first["loc"][:-1]):
                return err
    return first


def _too_big(source: str, size: int | None) -> str:
    if size is None:
        what = "more than 1 MiB"
    elif size >= 1.05 * 2**20:
        what = f"file is {size / 2**20:.1f} MiB"
    else:
        what = f"file is {size:,} bytes"
    return f"{source}: {what}; a cluster YAML is at most 1 MiB"


def _mark(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown position"


def _load_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load`` with the hostile-input checks of :class:`_GuardedLoader`, in one pass."""
    try:
        loader = _GuardedLoader(text, source)
        try:
            node = loader.get_single_node()
            _reject_duplicate_keys(node, (), source)
            return None if node is None else loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" ({_mark(mark)})" if mark else ""
        problem = exc.problem or exc.context or "parse error"
        if exc.context and problem.startswith("but "):  # "expected a single document ..., but found another"
            problem = f"{exc.context}, {problem}"
        raise ConfigError(f"{source}: not valid YAML{where}: {one_line(problem)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {one_line(str(exc))}") from None
    except ValueError as exc:  # from the constructor: an integer of over 4300 digits, a date such as 2024-13-45
        raise ConfigError(f"{source}: not valid YAML: {one_line(str(exc).split(';')[0])}") from None


class _GuardedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses, as each node arrives and before anything expands or recurses deeper:
    anchors and aliases (a few hundred bytes of them make billions of nodes), nesting deeper than MAX_DEPTH
    (the composer recurses once per level), and more than MAX_NODES nodes (the pure-Python parser needs
    some microseconds a node; a cluster file has a few hundred)."""

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self._source, self._depth, self._nodes = source, 0, 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        where = _mark(event.start_mark)
        if event.anchor is not None:
            what = f"alias *{event.anchor}" if isinstance(event, yaml.AliasEvent) else f"anchor &{event.anchor}"
            raise ConfigError(f"{self._source}: YAML anchors and aliases are not supported ({what} at {where}); "
                              f"write the value out in full")
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise ConfigError(f"{self._source}: more than {MAX_NODES:,} YAML keys and values ({where}); "
                              f"a cluster YAML has a few hundred")
        nested = isinstance(event, yaml.CollectionStartEvent)
        if nested:
            if self._depth >= MAX_DEPTH:
                raise ConfigError(f"{self._source}: lists and mappings nested more than {MAX_DEPTH} levels deep ({where})")
            self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= nested


def _reject_duplicate_keys(node: yaml.Node | None, path: tuple[str | int, ...], source: str) -> None:
    # yaml.safe_load keeps the last of two equal keys silently; a strict schema must not.
    # The graph is a tree here (no aliases) at most MAX_DEPTH deep, so this walk is linear.
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else "?"
            if name in seen:
                raise ConfigError(f"{source}: {yaml_path(path + (name,))}: duplicate key ({_mark(key.start_mark)})")
            seen.add(name)
            _reject_duplicate_keys(value, path + (name,), source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _reject_duplicate_keys(item, path + (i,), source)


def _check_data_path(cluster: ClusterConfig, source: str) -> None:
    """The agents read data.path only once training starts; find a bad one now, resolved as `up` resolves it."""
    given = cluster.data.path
    if given is None:
        return
    path = Path(given)
    shown = given if given.isprintable() else repr(given)
    if not path.is_absolute():
        try:
            shown += f" (in {os.getcwd()})"
        except OSError:  # the current directory was removed
            pass
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{source}: data.path: no such file: {shown}") from None
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL byte
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{source}: data.path: cannot use {show(given)}: {one_line(why)}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{source}: data.path: not a regular file: {shown}")
    if info.st_size == 0:
        raise ConfigError(f"{source}: data.path: file is empty: {shown}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{source}: data.path: not readable: {shown}")
    width = {"uint16": 2, "uint32": 4}[cluster.data.dtype]
    if cluster.data.format == "tokens" and info.st_size % width:
        raise ConfigError(f"{source}: data.path: {info.st_size} bytes is not a whole number of {cluster.data.dtype} "
                          f"token ids ({width} bytes each; is data.dtype right?): {shown}")
