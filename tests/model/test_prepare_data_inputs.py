"""`hetlaunch prepare-data` given what a hostile review gave it: the text file as its own output
(the corpus was replaced by token ids), a vocabulary whose ids exceed its entries (uint16 chosen
by the count: an OverflowError, or ids up to 60,000 for a "vocabulary of 3"), a local tokenizer
path that does not exist (24 s of Hugging Face hub retries before the error), an output name
with escape sequences (printed raw, retitling the terminal). Each failed before its fix."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import hetlaunch_env, run_hetlaunch

pytestmark = pytest.mark.timeout(120)


def _word_level(path, vocab: dict[str, int]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_the_text_file_is_never_its_own_output(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 20)
    tokenizer = _word_level(tmp_path / "tokenizer.json", {"[UNK]": 0, "hello": 1, "world": 2})
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", str(tokenizer), "-o", str(text), timeout=60)
    assert result.returncode == 2 and "is the text file itself" in result.stderr, result.stderr
    assert text.read_text() == "hello world\n" * 20


@pytest.mark.parametrize("top, dtype", [(60_000, "uint16"), (70_000, "uint32")])
def test_the_token_width_and_vocabulary_follow_the_largest_id(tmp_path, top, dtype):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 20)
    tokenizer = _word_level(tmp_path / "tokenizer.json", {"[UNK]": 0, "hello": top, "world": 5})
    out = tmp_path / "train.bin"
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", str(tokenizer), "-o", str(out), timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"as {dtype}, vocabulary {top + 1:,}." in result.stdout and f"vocab_size: {top + 1}" in result.stdout
    ids = np.fromfile(out, dtype=dtype)
    assert ids[:4].tolist() == [top, 5, top, 5]
    assert stat.S_IMODE(out.stat().st_mode) & 0o044  # as plain files are made (mkstemp's 0600 hid it from the group)


@pytest.mark.parametrize("name", ["missing/tokenizer.json", "./nowhere", "tok.json"])
def test_a_local_tokenizer_that_is_not_there_is_one_line_without_asking_the_hub(tmp_path, name):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n")
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", name, "-o", str(tmp_path / "o.bin"), timeout=20,
                           cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().endswith("no such tokenizer file"), result.stderr


def test_an_output_named_with_escape_sequences_is_printed_escaped(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 20)
    tokenizer = _word_level(tmp_path / "tokenizer.json", {"[UNK]": 0, "hello": 1, "world": 2})
    out = tmp_path / "e\x1b]0;TITLE\x07.bin"
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", str(tokenizer), "-o", str(out), timeout=60)
    assert result.returncode == 0 and "\x1b" not in result.stdout and "e\\x1b]0;TITLE\\x07.bin" in result.stdout


def _writing(pid: int, folder) -> bool:
    """Whether process `pid` holds a file open in `folder` that has no name there (O_TMPFILE)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{folder}/#") and target.endswith(" (deleted)"):
            return True
    return False


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 130), (signal.SIGKILL, -9)])
def test_a_signal_mid_way_leaves_nothing_behind(tmp_path, sig, code):
    """SIGTERM's default ended prepare-data with its hidden temp file left (gigabytes for a large
    corpus); it now unwinds as Ctrl-C does. A SIGKILL (the OOM killer) cannot be unwound: the
    token file has no name until it is whole, so nothing is left either."""
    from conftest import hetlaunch_cmd, hetlaunch_env

    text = tmp_path / "corpus.txt"
    with text.open("w") as f:
        for _ in range(400):
            f.write("hello world " * 20_000 + "\n")  # ~96 MB: tokenized for far longer than the test waits
    tokenizer = _word_level(tmp_path / "tokenizer.json", {"[UNK]": 0, "hello": 1, "world": 2})
    out = tmp_path / "train.bin"
    proc = subprocess.Popen(hetlaunch_cmd("prepare-data", str(text), "--tokenizer", str(tokenizer), "-o", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=hetlaunch_env())
    try:
        deadline = time.monotonic() + 60
        while not _writing(proc.pid, tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and _writing(proc.pid, tmp_path), "it never got to writing"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code and "Traceback" not in err, err  # SIGTERM ends it as Ctrl-C does
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "tokenizer.json"]


@pytest.mark.parametrize("given", ["out/", "existing"])
def test_an_output_that_names_a_folder_is_refused_before_any_work(tmp_path, given):
    # Path() drops a trailing slash: "-o out/" wrote a token file named "out".
    (tmp_path / "existing").mkdir()
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 20)
    tokenizer = _word_level(tmp_path / "tokenizer.json", {"[UNK]": 0, "hello": 1, "world": 2})
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", str(tokenizer), "-o", given, timeout=60,
                           cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: {given}: names a folder; give the file's name (e.g. " \
                            f"{given.rstrip('/')}/train.bin)\n"
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "existing", "tokenizer.json"]
    assert os.listdir(tmp_path / "existing") == []


@pytest.mark.parametrize("setting", ["truncation", "padding"])
def test_a_tokenizer_that_truncates_or_pads_writes_every_token_and_only_those(tmp_path, setting):
    """A tokenizer.json with truncation (or padding) set cut each 4 MiB piece to its length (or
    padded 15 tokens to 100,000) and prepare-data said nothing (a review)."""
    from tokenizers import Tokenizer

    path = _word_level(tmp_path / "tokenizer.json", {"[UNK]": 0, "hello": 1, "world": 2})
    tokenizer = Tokenizer.from_file(str(path))
    if setting == "truncation":
        tokenizer.enable_truncation(max_length=3)
    else:
        tokenizer.enable_padding(length=50, pad_id=0)
    tokenizer.save(str(path))
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 10 + "\n")
    out = tmp_path / "o.bin"
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", str(path), "-o", str(out), timeout=60)
    assert result.returncode == 0, result.stderr
    assert np.fromfile(out, dtype=np.uint16).tolist() == [1, 2] * 10


def test_a_tokenizer_that_fails_on_the_text_is_one_line(tmp_path):
    """A WordLevel tokenizer whose unknown token is not in its vocabulary raised its own Exception
    through the CLI: a traceback, exit 1 (a review)."""
    path = _word_level(tmp_path / "tokenizer.json", {"hello": 1, "world": 2})
    text = tmp_path / "t.txt"
    text.write_text("hello there\n")
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", str(path), "-o", str(tmp_path / "o.bin"),
                           timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "the tokenizer failed on" in result.stderr and not (tmp_path / "o.bin").exists()


def test_the_yaml_line_it_prints_reads_back_as_the_path(tmp_path):
    """The `data:` line was printed unquoted: a path with ", " or " #" in it read back as something
    else, or not at all (a review)."""
    import yaml

    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 20)
    tokenizer = _word_level(tmp_path / "tokenizer.json", {"[UNK]": 0, "hello": 1, "world": 2})
    out = tmp_path / "a, b #c: d.bin"
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", str(tokenizer), "-o", str(out), timeout=60)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith("data:"))
    assert yaml.safe_load(line)["data"] == {"format": "tokens", "path": str(out), "dtype": "uint16"}


def _hub_env(tmp_path) -> dict:
    """A Hugging Face cache of our own and a hub at a closed loopback port: no traffic leaves."""
    with socket.socket() as probe:  # a port nothing listens on: bound, then closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {**hetlaunch_env(), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": f"http://127.0.0.1:{port}",
            "HF_HUB_OFFLINE": "0"}


def test_a_hub_name_with_the_hub_unreachable_is_one_line_at_once(tmp_path):
    """The hub client retried a refused connection for 24 s before this error."""
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n")
    started = time.monotonic()
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", "someorg/sometokenizer", "-o",
                           str(tmp_path / "o.bin"), timeout=60, env=_hub_env(tmp_path))
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nor in the Hugging Face cache" in lines[0] and "cannot be reached" in lines[0], lines
    assert took < 15, took  # an interpreter start and the refused connection, not the client's backoff
    assert not (tmp_path / "o.bin").exists()


def test_a_hub_tokenizer_in_the_local_cache_is_used_with_the_hub_unreachable(tmp_path):
    env = _hub_env(tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--sometokenizer"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    _word_level(repo / "snapshots" / commit / "tokenizer.json", {"[UNK]": 0, "hello": 1, "world": 2})
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 3)
    out = tmp_path / "train.bin"
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", "someorg/sometokenizer", "-o", str(out),
                           timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert np.fromfile(out, dtype="uint16").tolist() == [1, 2] * 3


@pytest.mark.parametrize("variable", ["HTTPS_PROXY", "all_proxy"])
def test_a_hub_name_is_fetched_through_the_proxy_the_environment_names(tmp_path, variable):
    """A first version of the reachability check dialled the hub itself: behind a proxy (the only
    way out of many clusters) every hub tokenizer not cached failed. The proxy here is a loopback
    listener that refuses the tunnel the client asks for."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    asked = []

    def proxy():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            asked.append(conn.recv(200))
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            conn.close()
    threading.Thread(target=proxy, daemon=True).start()
    env = {k: v for k, v in hetlaunch_env().items()
           if k.lower() not in ("no_proxy", "hf_endpoint", "https_proxy", "http_proxy", "all_proxy")}
    env.update({variable: f"http://127.0.0.1:{listener.getsockname()[1]}", "HF_HUB_CACHE": str(tmp_path / "hub"),
                "HF_HUB_OFFLINE": "0"})
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n")
    try:
        result = run_hetlaunch("prepare-data", str(text), "--tokenizer", "someorg/sometokenizer", "-o",
                               str(tmp_path / "o.bin"), timeout=90, env=env)
    finally:
        listener.close()
    assert asked and asked[0].startswith(b"CONNECT huggingface.co:443 "), asked
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "fetching it from the hub failed" in lines[0], lines


@pytest.mark.parametrize("endpoint", ["https://hub.example:99999", "https://hub.example:4x3"])
def test_a_hub_endpoint_that_is_not_a_url_is_one_line(tmp_path, endpoint):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n")
    env = {**_hub_env(tmp_path), "HF_ENDPOINT": endpoint}
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", "gpt2", "-o", str(tmp_path / "o.bin"),
                           timeout=60, env=env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "is HF_ENDPOINT a URL?" in lines[0], result.stderr


def test_a_name_that_is_neither_a_file_nor_a_hub_name_says_so(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n")
    result = run_hetlaunch("prepare-data", str(text), "--tokenizer", "bad name//x", "-o", str(tmp_path / "o.bin"),
                           timeout=60, env=_hub_env(tmp_path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "nor a hub name" in lines[0], result.stderr
