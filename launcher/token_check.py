"""`validate` and `up` check every id of the cluster's token file against the model's vocabulary
on this host, before anything starts (runtime/token_file.py: one vectorised pass, about 0.15 s
per GB from the page cache), so one bad id at the end of a corpus is a one-line error now, not
a crash hours into the run.

Where the vocabulary comes from: the built-in GPT's is in the YAML (no torch). An entrypoint's
is known only to the model: `validate` asks it (importing torch and the entrypoint, here);
`up` does not, so the coordinator stays free of torch, and leaves the check to the stages,
which run it when they open the file (runtime/data.py), still before the first step. Every
stage checks the copy it reads, since a remote node has its own copy of the file.
"""

from __future__ import annotations

from hetlaunch.launcher.cluster_config import ClusterConfig
from hetlaunch.runtime.token_file import check_token_ids, token_file


class BadTokens(ValueError):
    """A token id outside the vocabulary, or a file that cannot be read as tokens: one line."""


def model_vocabulary(cluster: ClusterConfig, ask_entrypoint: bool) -> tuple[int | None, str]:
    """(vocabulary or None, why None)."""
    spec = cluster.model.to_spec()
    if spec.gpt is not None:
        return spec.gpt.vocab_size, ""
    if not ask_entrypoint:
        return None, "the stages check them against the model's vocabulary when they open the file"
    try:
        from hetlaunch.runtime.model import describe_model

        vocab = describe_model(spec, seed=0).vocab_size
    except Exception as err:  # not importable on this host (agents may have it): the stages still check
        return None, (f"cannot ask {spec.entrypoint} its vocabulary here ({type(err).__name__}: "
                      f"{' '.join(str(err).split())}); the stages check them when they open the file")
    if vocab is None:
        return None, f"{spec.entrypoint} names no vocabulary (LayeredModel.vocab_size or a vocab_size kwarg)"
    return vocab, ""


def check_tokens(cluster: ClusterConfig, source: str, ask_entrypoint: bool) -> str | None:
    """Raise BadTokens for an id outside the vocabulary; return what was checked (None: no token
    file). `source` names the YAML in the message."""
    data = cluster.data
    if data.format != "tokens" or data.path is None:
        return None
    vocab, why = model_vocabulary(cluster, ask_entrypoint)
    if vocab is None:
        return f"token ids of {data.path} not checked here: {why}"
    try:
        tokens = token_file(data.path, data.dtype)
        check_token_ids(tokens, vocab, f"{source}: data.path: {data.path}")
    except (OSError, ValueError) as err:
        raise BadTokens(" ".join(str(err).split())) from None
    return f"token ids: all {len(tokens):,} of {data.path} below the vocabulary of {vocab:,}"
