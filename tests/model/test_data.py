"""Byte-level batches: same (seed, step) gives the same batch in every process."""

import pytest
import torch

from hetlaunch.runtime.data import TokenBatches, text_file, stdlib_text_bytes

torch.set_num_threads(1)

TEXT = bytes(range(256)) * 8  # every byte value, so windows are easy to check


def test_stdlib_text_is_real_deterministic_and_capped():
    data = stdlib_text_bytes(200_000)
    assert len(data) == 200_000
    assert b"def " in data and b"import " in data
    assert stdlib_text_bytes(200_000) is data  # cached in-process
    stdlib_text_bytes.cache_clear()
    assert stdlib_text_bytes(200_000) == data  # and the same after a fresh read
    # A smaller cap is a prefix of a larger one: the file order does not depend on the cap.
    assert stdlib_text_bytes(50_000) == data[:50_000]
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_text_bytes(0)


def test_shapes_dtypes_and_shift():
    tb = TokenBatches(TEXT, seq_len=16, seed=0)
    x, y = tb.batch(step=3, batch_size=5)
    assert x.shape == y.shape == (5, 16)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    # TEXT counts up mod 256, so every target is its input plus one.
    assert torch.equal(y, (x + 1) % 256)
    assert int(x.min()) >= 0 and int(x.max()) < 256


def test_windows_come_from_the_data():
    data = b"hello, world. " * 20
    tb = TokenBatches(data, seq_len=10, seed=4)
    x, y = tb.batch(0, 8)
    for row_x, row_y in zip(x, y):
        window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert window in data


def test_determinism_across_instances_and_call_order():
    data = stdlib_text_bytes(100_000)
    a = TokenBatches(data, seq_len=32, seed=7)
    b = TokenBatches(data, seq_len=32, seed=7)
    forward = [a.batch(step, 4) for step in range(5)]
    backward = [b.batch(step, 4) for step in reversed(range(5))][::-1]
    for (xa, ya), (xb, yb) in zip(forward, backward):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # Different steps and different seeds give different batches.
    assert not torch.equal(forward[0][0], forward[1][0])
    assert not torch.equal(TokenBatches(data, 32, seed=8).batch(0, 4)[0], forward[0][0])
    # Drawing batches does not consume or depend on the global RNG.
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    a.batch(9, 4)
    assert torch.equal(torch.rand(2), expected)


def test_micro_batches_split_the_global_batch():
    tb = TokenBatches(stdlib_text_bytes(100_000), seq_len=8, seed=1)
    x, y = tb.batch(2, 12)
    micro = tb.micro_batches(2, micro_batch_size=3, num_microbatches=4)
    assert len(micro) == 4
    assert all(mx.shape == (3, 8) and my.shape == (3, 8) for mx, my in micro)
    assert torch.equal(torch.cat([mx for mx, _ in micro]), x)
    assert torch.equal(torch.cat([my for _, my in micro]), y)
    # The same global batch whichever way it is cut.
    other = tb.micro_batches(2, micro_batch_size=6, num_microbatches=2)
    assert torch.equal(torch.cat([mx for mx, _ in other]), x)


def test_batch_argument_errors():
    tb = TokenBatches(TEXT, seq_len=4, seed=0)
    with pytest.raises(ValueError, match="step"):
        tb.batch(-1, 2)
    with pytest.raises(ValueError, match="batch_size"):
        tb.batch(0, 0)
    with pytest.raises(ValueError, match="num_microbatches"):
        tb.micro_batches(0, 2, 0)


def test_data_too_short():
    with pytest.raises(ValueError, match="seq_len \\+ 2"):
        TokenBatches(b"x" * 17, seq_len=16, seed=0)
    tb = TokenBatches(b"abcdefghijklmnopqr", seq_len=16, seed=0)  # exactly seq_len + 2
    x, y = tb.batch(0, 32)
    assert set(x[:, 0].tolist()) <= {ord("a"), ord("b")}
    with pytest.raises(ValueError, match="seq_len"):
        TokenBatches(TEXT, seq_len=0, seed=0)


def test_file_source(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog\n" * 10)
    data = text_file(str(path))
    assert data.tobytes() == path.read_bytes() and not data.flags.writeable  # mapped, not read into memory
    x, y = TokenBatches(data, seq_len=12, seed=0).batch(0, 3)
    assert x.shape == (3, 12)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        text_file(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        text_file(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="not a regular file"):
        text_file(str(tmp_path))
