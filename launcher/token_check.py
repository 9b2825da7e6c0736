"""`validate` and `up` check every id of the cluster's token file against the model's vocabulary
on this host, before anything starts (runtime/token_file.py: one vectorised pass, about 0.15 s
per GB from the page cache), so one bad id at the end of a corpus is a one-line error now, not
a crash hours into the run.

Where the vocabulary comes from: the built-in GPT's is in the YAML (no torch). An entrypoint's
is known only to the model: `validate` asks it (importing torch and the entrypoint, here) where
the entrypoint is hetlaunch's own or `--allow-entrypoint` matches it (a YAML from elsewhere can
name any code, and validate is what one runs on it first); `up` does not, so the coordinator stays free of torch, and leaves the check to the stages,
which run it when they open the file (runtime/data.py), still before the first step. Every
stage checks the copy it reads, since a remote node has its own copy of the file.
"""

from __future__ import annotations

import os

import numpy as np

from hetlaunch.launcher.cluster_config import ClusterConfig
from hetlaunch.runtime.entrypoint_patterns import OWN_ENTRYPOINTS, entrypoint_allowed
from hetlaunch.runtime.token_file import check_token_ids, token_file


class BadTokens(ValueError):
    """A token id outside the vocabulary, or a file that cannot be read as tokens: one line."""


def model_vocabulary(cluster: ClusterConfig, ask_entrypoint: tuple[str, ...] | None) -> tuple[int | None, str]:
    """(vocabulary or None, why None). `ask_entrypoint`: the patterns of entrypoints that may be
    imported here to ask (hetlaunch's own always may); None: none is."""
    spec = cluster.model.to_spec()
    if spec.gpt is not None:
        return spec.gpt.vocab_size, ""
    if ask_entrypoint is None:
        return None, "the stages check them against the model's vocabulary when they open the file"
    if not entrypoint_allowed(spec.entrypoint, (*OWN_ENTRYPOINTS, *ask_entrypoint)):
        return None, (f"validate imports {spec.entrypoint} to ask its vocabulary only where --allow-entrypoint "
                      f"matches it (a YAML can name any code); the stages check them when they open the file")
    try:
        from hetlaunch.runtime.model import describe_model

        vocab = describe_model(spec, seed=0).vocab_size
    except Exception as err:  # not importable on this host (agents may have it): the stages still check
        return None, (f"cannot ask {spec.entrypoint} its vocabulary here ({type(err).__name__}: "
                      f"{' '.join(str(err).split())}); the stages check them when they open the file")
    if vocab is None:
        return None, f"{spec.entrypoint} names no vocabulary (LayeredModel.vocab_size or a vocab_size kwarg)"
    return vocab, ""


def check_tokens(cluster: ClusterConfig, source: str, ask_entrypoint: tuple[str, ...] | None) -> str | None:
    """Raise BadTokens for an id outside the vocabulary, or a data file too short to draw a
    sample from; return what was checked (None: no token file). `source` names the YAML in the message."""
    data = cluster.data
    where = f"{source}: data.path: {data.path}"
    if data.format != "tokens" or data.path is None:
        if data.path is not None and os.path.isfile(data.path):  # text: a token a byte
            check_length(cluster, os.path.getsize(data.path), where)
            vocab, _ = model_vocabulary(cluster, ask_entrypoint)
            if vocab is not None and vocab < 256:  # a byte past it passed here and crashed step 140 (a review)
                try:
                    check_token_ids(np.memmap(data.path, dtype=np.uint8, mode="r"), vocab, where)
                except (OSError, ValueError) as err:
                    raise BadTokens(" ".join(str(err).split())) from None
                return f"bytes: all of {data.path} below the vocabulary of {vocab:,}"
        if data.path is None and data.format != "tokens":  # the default text, a token a byte, as the stages read it
            vocab, _ = model_vocabulary(cluster, ask_entrypoint)
            if vocab is not None and vocab < 256:  # validate said ok and every stage refused it (a review)
                from hetlaunch.runtime.default_text import stdlib_text_bytes

                try:
                    check_token_ids(np.frombuffer(stdlib_text_bytes(), dtype=np.uint8),
                                    vocab, f"{source}: without data.path, the standard library's text")
                except ValueError as err:
                    raise BadTokens(" ".join(str(err).split()) + "; set data.path") from None
                return f"bytes: all of the standard library's text below the vocabulary of {vocab:,}"
        return None
    vocab, why = model_vocabulary(cluster, ask_entrypoint)
    if vocab is None and not os.path.isfile(data.path):  # the stages' own copies are what they check
        return f"token ids of {data.path} not checked here: {why}"
    try:
        tokens = token_file(data.path, data.dtype)
    except (OSError, ValueError) as err:
        raise BadTokens(" ".join(str(err).split())) from None
    check_length(cluster, len(tokens), where)
    if vocab is None:
        return f"token ids of {data.path} not checked here: {why}"
    try:
        check_token_ids(tokens, vocab, where)
    except (OSError, ValueError) as err:
        raise BadTokens(" ".join(str(err).split())) from None
    return f"token ids: all {len(tokens):,} of {data.path} below the vocabulary of {vocab:,}"


def check_length(cluster: ClusterConfig, tokens: int, where: str) -> None:
    """The data (and its held-out tail, with evaluation) holds a window of seq_len + 1 tokens and
    one more, as the stages require (runtime/data.py TokenBatches): else `up` started every agent
    and failed in a stage."""
    need = cluster.model.to_spec().seq_len + 2
    fraction = cluster.data.eval_fraction if cluster.train.eval_every else 0.0
    cut = int(tokens * (1.0 - fraction)) if fraction else tokens  # as runtime/data.py open_data cuts it
    parts = [(f" (less its held-out last {fraction:g})" if fraction else "", cut)]
    if fraction:
        parts.append((f" (its held-out last {fraction:g})", tokens - cut))
    for part, count in parts:
        if count < need:
            raise BadTokens(f"{where}{part} has {count:,} tokens; need at least seq_len + 2 = {need:,}")
