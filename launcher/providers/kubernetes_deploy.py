"""`hetlaunch deploy k8s`: the manifests launcher/providers/kubernetes.py renders, written into a
directory for `kubectl apply -f`, every file whole or none, with the join token they share."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml

from hetlaunch.launcher.plain_text import escape_controls
from hetlaunch.launcher.providers.kubernetes import MAX_SECRET_BYTES, REVISION, TOKEN_KEY, render, tls_sources
from hetlaunch.launcher.providers.manifest_yaml import manifests_text
from hetlaunch.runtime.auth import TOKEN_ENV_VAR, read_token
from hetlaunch.runtime.files import UnreadableFile, read_regular_file, write_whole


class DeployError(Exception):
    """One line for the user: the CLI prints it and exits 2."""


@dataclass
class Deployed:
    written: list[Path]  # every file rendered, in order
    overwritten: list[Path]  # those of them that replaced a file already there
    others: list[Path]  # manifests in the directory this render did not write (kubectl apply -f applies them too)
    new_token: Path | None  # where a token made up for this render was written, or None


def deploy(cluster, directory: Path, token_file: Path | None, source: str) -> Deployed:
    """Render the manifests of `cluster` into `directory` (made if missing): every file whole, or none.
    The token: --token-file, else $HETLAUNCH_TOKEN, else DIRECTORY/token from an earlier render,
    else a new one, written there (not a manifest: kubectl apply -f DIR reads only .yaml, .yml and
    .json) for `hetlaunch up --token-file`."""
    if cluster.kubernetes is None:
        raise DeployError(f"{source}: no kubernetes: section; list the node groups to run there "
                          "(README: Kubernetes)")
    if directory.exists() and not directory.is_dir():
        raise DeployError(f"-o {directory}: is not a directory (the manifests go into one)")
    new_token = None
    try:
        if token_file is not None or os.environ.get(TOKEN_ENV_VAR):
            token = read_token(str(token_file) if token_file else None)
        elif (directory / "token").is_file():  # rendered again: the token running agents and `up` already hold
            try:
                token = read_token(str(directory / "token"))
            except ValueError as err:
                raise ValueError(f"{err} (delete it to have a new token made)") from None
        else:
            token, new_token = secrets.token_urlsafe(24), directory / "token"
    except ValueError as err:
        raise DeployError(str(err)) from None
    from hetlaunch.runtime.tls import MAX_PEM_BYTES  # here: runtime/tls.py loads grpc, which `validate` never does

    pems = {}
    for key, (field, path) in tls_sources(cluster).items():
        try:  # never blocks on a FIFO, never reads /dev/zero to the end
            pems[key] = read_regular_file(path, MAX_PEM_BYTES).decode("ascii")
        except FileNotFoundError:
            raise DeployError(f"{field}: cannot read {escape_controls(path)} (no such file)") from None
        except (UnreadableFile, UnicodeDecodeError) as err:
            why = str(err) if isinstance(err, UnreadableFile) else "not a PEM text file"
            raise DeployError(f"{field}: cannot read {escape_controls(path)} ({why})") from None
    out = escape_controls(str(directory))
    header = f"# rendered by `hetlaunch deploy k8s {escape_controls(source)}`: kubectl apply -f {out}\n"
    texts = {name: header + manifests_text(docs)
             for name, docs in render(cluster, token, pems, secret_revision(directory, token, pems)).items()}
    if new_token is not None:
        texts[new_token.name] = token + "\n"
    paths = [directory / name for name in texts]
    _check_targets(paths, Path(source), out)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        overwritten = [p for p in paths if p.exists()]
        others = sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml", ".json") and p not in paths)
    except OSError as err:
        raise DeployError(f"-o {out}: cannot write ({err.strerror or err})") from None
    # Every file in full beside its place first, then each renamed over it: a failure part way
    # (a full disk) leaves none of this render, so never a Secret with a token nobody has.
    written: list[tuple[Path, Path]] = []
    try:
        for path in paths:
            staged = path.with_name(f".{path.name}.{secrets.token_hex(4)}.staged")
            write_whole(staged, texts[path.name], mode=0o600 if path.name in ("secret.yaml", "token") else 0o644)
            written.append((staged, path))
        for staged, path in written:
            os.replace(staged, path)
    except OSError as err:
        for staged, _ in written:
            staged.unlink(missing_ok=True)
        raise DeployError(f"-o {out}: cannot write {path.name} ({err.strerror or err})") from None
    return Deployed(paths, overwritten, others, new_token)


def _check_targets(paths: list[Path], source: Path, out: str) -> None:
    """Refuse, before anything is written, a render that would replace its own cluster YAML or
    write where a directory stands."""
    for path in paths:
        if path.is_dir():
            raise DeployError(f"-o {out}: {path.name} is a directory; the render writes a file there")
        try:
            same = path.exists() and source.exists() and path.samefile(source)
        except OSError:
            same = False
        if same:
            raise DeployError(f"-o {out}: the render would overwrite its own cluster YAML {escape_controls(str(source))} "
                              f"({path.name}); render into another directory")


def secret_revision(directory: Path, token: str, tls_files: dict[str, str]) -> str:
    """The revision of the Secret rendered into `directory` before, where it held exactly this
    content; else a new random one (so the pods roll onto the new content)."""
    try:  # never blocks on a FIFO, never reads /dev/zero to the end (a hostile review planted both)
        before = yaml.safe_load(read_regular_file(directory / "secret.yaml", MAX_SECRET_BYTES).decode("utf-8"))
        if before["stringData"] == {TOKEN_KEY: token, **tls_files}:
            return str(before["metadata"]["annotations"][REVISION])
    except (OSError, UnreadableFile, UnicodeDecodeError, RecursionError, yaml.YAMLError, KeyError, TypeError):
        pass  # none before, or not one of ours: a new revision
    return secrets.token_hex(8)

