"""How long checking every id of a token file takes (runtime/token_file.py: `validate`, `up` and
each stage that opens the file run it before training).

A generated file of random ids below the vocabulary with one bad id at the very end (so the
whole file is read), uint16 and uint32, in a temporary directory that is removed afterwards.
Timed after one warming pass, so the figure is the check itself with the file in the page
cache; from a cold disk the read dominates (the disk's own GB/s). Figure: seconds per GB
(10^9 bytes), the slower dtype's median.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _harness import NullReporter, Reporter

from hetlaunch.runtime.token_file import first_id_outside, token_file

VOCAB = 50_257  # GPT-2's
WRITE_CHUNK = 1 << 24  # tokens generated and written at a time: memory stays small


def _write(path: Path, dtype: str, num_bytes: int) -> int:
    rng = np.random.default_rng(0)
    tokens = num_bytes // np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        for start in range(0, tokens, WRITE_CHUNK):
            ids = rng.integers(0, VOCAB, min(WRITE_CHUNK, tokens - start), dtype=dtype)
            if start + len(ids) == tokens:
                ids[-1] = VOCAB  # the one bad id, last
            ids.tofile(f)
    return tokens


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    num_bytes, reps = (256 << 20, 3) if quick else (2 << 30, 5)
    reporter.total(2 * (reps + 1))
    cases = []
    with tempfile.TemporaryDirectory(prefix="hetlaunch-token-check-") as tmp:
        for dtype in ("uint16", "uint32"):
            path = Path(tmp) / f"tokens-{dtype}.bin"
            tokens = _write(path, dtype, num_bytes)
            data = token_file(str(path), dtype)
            reporter.advance(f"{dtype}: warming")
            assert first_id_outside(data, VOCAB) == (tokens - 1, VOCAB)
            runs = []
            for rep in range(reps):
                reporter.advance(f"{dtype} ({rep + 1}/{reps})")
                started = time.perf_counter()
                found = first_id_outside(data, VOCAB)
                runs.append(time.perf_counter() - started)
                assert found == (tokens - 1, VOCAB)
            median = statistics.median(runs)
            cases.append({"dtype": dtype, "bytes": num_bytes, "tokens": tokens, "runs_s": runs, "median_s": median,
                          "s_per_gb": median / (num_bytes / 1e9)})
            del data
            path.unlink()
    reporter.advance("done")
    worst = max(cases, key=lambda c: c["s_per_gb"])
    return {
        "description": "runtime/token_file.first_id_outside over a memory-mapped token file with one bad id at the "
                       "end (every id read), file in the page cache; median of repetitions",
        "config": {"vocab_size": VOCAB, "file_bytes": num_bytes, "repetitions": reps},
        "cases": cases,
        "figure": {"name": f"seconds per GB ({worst['dtype']})", "value": worst["s_per_gb"], "target": "<= 1.0"},
        "met": worst["s_per_gb"] <= 1.0,
    }
