"""Token files (nanoGPT's format): deterministic batches equal to nanoGPT's sampling, every id
checked against the vocabulary before training (`validate`, `up`, the stages) with one-line
errors naming it, clear errors for files that are not whole tokens, `hetlaunch prepare-data`
with a real tokenizer, and a run that trains on its output."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import hetlaunch_cmd, hetlaunch_env, run_hetlaunch
from hetlaunch.runtime.data import TokenBatches, batch_seed, open_data, token_file

torch.set_num_threads(1)


def write_tokens(path, ids, dtype="uint16"):
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def nanogpt_get_batch(data: np.ndarray, block_size: int, batch_size: int):
    """nanoGPT's train.py get_batch on the CPU, verbatim in substance."""
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64)) for i in ix])
    return x, y


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_batches_are_nanogpt_sampling_under_the_step_seed(tmp_path, dtype):
    ids = np.random.default_rng(0).integers(0, 50_000, 5_000)
    path = write_tokens(tmp_path / "train.bin", ids, dtype)
    batches = TokenBatches(token_file(str(path), dtype), seq_len=32, seed=9, vocab_size=50_257)
    for step in (0, 1, 17):
        x, y = batches.batch(step, 6)
        torch.manual_seed(batch_seed(9, step))
        want_x, want_y = nanogpt_get_batch(np.memmap(path, dtype=dtype, mode="r"), 32, 6)
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
        assert x.dtype == torch.int64
    again = TokenBatches(token_file(str(path), dtype), seq_len=32, seed=9, vocab_size=50_257)
    assert torch.equal(again.batch(17, 6)[0], batches.batch(17, 6)[0])  # per (seed, step), any process


def test_an_id_outside_the_vocabulary_names_the_file(tmp_path):
    path = write_tokens(tmp_path / "train.bin", [1, 2, 3, 4] * 20 + [300] * 40)
    # Found when the file is opened, not when a window happens to draw it.
    with pytest.raises(ValueError, match=r"data file '.*train\.bin' holds token id 300, outside the model's "
                                         r"vocabulary of 256 \(ids 0..255\), at position 80 of 120$"):
        open_data(str(path), "tokens", "uint16", seq_len=8, seed=0, vocab_size=256)
    batches = TokenBatches(token_file(str(path), "uint16"), seq_len=8, seed=0, vocab_size=256)
    with pytest.raises(ValueError, match="holds token id 300"):  # a window still refuses it, drawn directly
        for step in range(50):
            batches.batch(step, 4)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_every_id_is_checked_in_chunks_and_the_first_bad_one_is_named(monkeypatch, dtype):
    import hetlaunch.runtime.token_file as tf

    monkeypatch.setattr(tf, "CHUNK_TOKENS", 7)  # many chunks, bad ids on and across their edges
    ids = np.random.default_rng(1).integers(0, 1000, 100).astype(dtype)
    assert tf.first_id_outside(ids, 1000) is None
    for position in (0, 6, 7, 50, 99):
        bad = ids.copy()
        bad[position], bad[-1] = 1000 + position, 5000
        assert tf.first_id_outside(bad, 1000) == ((position, 1000 + position) if position < 99 else (99, 5000))
    with pytest.raises(ValueError, match=r"^f holds token id 5000, outside the model's vocabulary of 1000 "
                                         r"\(ids 0..999\), at position 99 of 100$"):
        tf.check_token_ids(bad, 1000, "f")


def _validate_fails_on_the_last_id(tmp_path, model: str, vocab: int, *flags: str):
    path = write_tokens(tmp_path / "train.bin", [7] * 69_999 + [vocab])  # one bad id, at the very end
    (tmp_path / "c.yaml").write_text(f"name: t\nmodel: {model}\ndata: {{format: tokens, path: {path}}}\n"
                                     "nodes: [{name: a}]\n")
    result = run_hetlaunch("validate", str(tmp_path / "c.yaml"), *flags, timeout=90)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == (f"error: {tmp_path / 'c.yaml'}: data.path: {path} holds token id {vocab}, outside the "
                             f"model's vocabulary of {vocab} (ids 0..{vocab - 1}), at position 69999 of 70000\n")
    write_tokens(path, [7] * 70_000)
    result = run_hetlaunch("validate", str(tmp_path / "c.yaml"), *flags, timeout=90)
    assert result.returncode == 0, result.stderr
    assert f"token ids: all 70,000 of {path} below the vocabulary of {vocab:,}" in result.stdout


def test_a_32_bit_token_file_read_as_16_bit_is_named_not_trained_on(tmp_path):
    """prepare-data writes uint32 for a vocabulary past 65,536; read with the default uint16 every
    other id was a high half (0 or 1), all below the vocabulary, and training ran on it (a review)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128_256, size=20_000)
    path = write_tokens(tmp_path / "wide.bin", ids, "uint32")
    with pytest.raises(ValueError, match="looks like a uint32 token file read as uint16.*set data.dtype: uint32"):
        open_data(str(path), "tokens", "uint16", seq_len=8, seed=0, vocab_size=128_256)
    open_data(str(path), "tokens", "uint32", seq_len=8, seed=0, vocab_size=128_256)  # read as written
    narrow = write_tokens(tmp_path / "narrow.bin", rng.integers(0, 65_536, size=20_000), "uint16")
    open_data(str(narrow), "tokens", "uint16", seq_len=8, seed=0, vocab_size=128_256)  # 16-bit ids of a big model


def test_text_data_is_checked_against_a_vocabulary_under_a_byte(tmp_path):
    """Text is a token a byte: with vocab_size 128, one byte of an 'e' with an accent passed
    `validate` and crashed the run at step 140 (a review). Refused at validate and when opened."""
    text = tmp_path / "t.txt"
    text.write_text("plain ascii text " * 400 + "caf\u00e9\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds token id 195, outside the model's vocabulary of 128"):
        open_data(str(text), "text", "uint16", seq_len=8, seed=0, vocab_size=128)
    (tmp_path / "c.yaml").write_text(f"name: t\nmodel: {{preset: tiny, vocab_size: 128}}\n"
                                     f"data: {{format: text, path: {text}}}\nnodes: [{{name: a}}]\n")
    result = run_hetlaunch("validate", str(tmp_path / "c.yaml"), timeout=90)
    assert result.returncode == 2 and "holds token id 195" in result.stderr, result.stdout + result.stderr
    text.write_text("plain ascii text " * 400, encoding="utf-8")
    result = run_hetlaunch("validate", str(tmp_path / "c.yaml"), timeout=90)
    assert result.returncode == 0 and "below the vocabulary of 128" in result.stdout, result.stderr


def test_validate_checks_every_token_id_against_the_built_in_models_vocabulary(tmp_path):
    _validate_fails_on_the_last_id(tmp_path, "{preset: tiny, vocab_size: 300}", 300)


def test_validate_asks_an_entrypoint_model_its_vocabulary_where_allowed(tmp_path):
    _validate_fails_on_the_last_id(tmp_path, "{entrypoint: user_model:make_layered_mlp_lm, kwargs: "
                                             "{seq_len: 16, vocab_size: 260}}", 260, "--allow-entrypoint", "user_model:*")


def test_validate_imports_no_entrypoint_it_was_not_allowed(tmp_path):
    """validate is what one runs on a YAML from elsewhere, and it imported whatever it named:
    logging:basicConfig with a filename truncated that file (a hostile review). Only hetlaunch's
    own models, or what --allow-entrypoint matches, are imported."""
    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    path = write_tokens(tmp_path / "train.bin", [7] * 1000)
    (tmp_path / "c.yaml").write_text(
        f"name: t\nmodel: {{entrypoint: 'logging:basicConfig', kwargs: {{seq_len: 4, filename: '{victim}', "
        f"filemode: w}}}}\ndata: {{format: tokens, path: {path}}}\nnodes: [{{name: a}}]\n")
    result = run_hetlaunch("validate", str(tmp_path / "c.yaml"), timeout=90)
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "kept"
    assert (f"token ids of {path} not checked here: validate imports logging:basicConfig to ask its vocabulary only "
            "where --allow-entrypoint matches it") in result.stdout, result.stdout


def test_files_that_are_not_whole_tokens_are_refused(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match=r"odd\.bin' has 3 bytes, not a whole number of uint16 tokens"):
        token_file(str(odd), "uint16")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="has 0 bytes"):
        token_file(str(empty), "uint16")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        token_file(str(tmp_path / "missing.bin"), "uint16")
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(f"name: t\ndata: {{format: tokens, path: {odd}}}\nnodes: [{{name: a}}]\n")
    result = run_hetlaunch("validate", str(yaml_path), timeout=60)
    assert result.returncode == 2 and "3 bytes is not a whole number of uint16 token ids" in result.stderr
    yaml_path.write_text("name: t\ndata: {format: tokens}\nnodes: [{name: a}]\n")
    result = run_hetlaunch("validate", str(yaml_path), timeout=60)
    assert result.returncode == 2 and "data.path: a token file is required" in result.stderr


@pytest.mark.timeout(120)
def test_validate_refuses_data_too_short_to_draw_a_sample_from(tmp_path):
    """It said ok, and `up` started every agent before a stage refused the file."""
    short = write_tokens(tmp_path / "short.bin", [7] * 17)  # seq_len 16 needs 18
    text = tmp_path / "short.txt"
    text.write_text("x" * 17)
    model = "{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}"
    yaml_path = tmp_path / "c.yaml"
    tokens = write_tokens(tmp_path / "k.bin", [7] * 1000)
    for data, count, part, eval_every in [
            (f"{{format: tokens, path: {short}}}", 17, "", 0), (f"{{path: {text}}}", 17, "", 0),
            # 1,000 tokens, a tenth held out for evaluation: 900 and 100; 200 tokens a sample
            (f"{{format: tokens, path: {tokens}}}", 100, " (its held-out last 0.1)", 5)]:
        seq_len = 198 if eval_every else 16
        yaml_path.write_text(f"name: t\nmodel: {model.replace('seq_len: 16', f'seq_len: {seq_len}')}\ndata: {data}\n"
                             f"train: {{eval_every: {eval_every}}}\nnodes: [{{name: a}}]\n")
        for command in ("validate", "up"):
            result = run_hetlaunch(command, str(yaml_path), *(["--run-dir", str(tmp_path / "run")] if command == "up"
                                                              else []), timeout=90)
            assert result.returncode == 2, result.stdout + result.stderr
            assert result.stderr.startswith(f"error: {yaml_path}: data.path: ") and result.stderr.endswith(
                f"{part} has {count} tokens; need at least seq_len + 2 = {seq_len + 2}\n"), result.stderr
            assert not (tmp_path / "run").exists()


def test_the_held_out_tail_is_never_in_training_windows(tmp_path):
    path = write_tokens(tmp_path / "train.bin", np.arange(1000))  # each id tells its position
    train, held_out = open_data(str(path), "tokens", "uint16", seq_len=8, seed=0, vocab_size=1000, eval_fraction=0.1)
    assert (len(train), len(held_out)) == (900, 100)
    seen = torch.cat([torch.cat(train.batch(s, 16)).flatten() for s in range(30)])
    assert int(seen.max()) < 900 and int(seen.max()) > 850
    held = torch.cat(held_out.micro_batches(0, 4, 2)[0])
    assert int(held.min()) >= 900


@pytest.mark.parametrize("data_format", ["tokens", "text"])
def test_a_data_file_cut_short_while_training_is_one_line_not_sigbus(tmp_path, data_format):
    # Reading a memory-mapped file past its new end (beyond the page that holds it) kills the reader
    # with SIGBUS; run in a child so that, were the check missing, the test fails on the child's
    # signal instead of dying with it. 128 KiB, so the windows drawn fall pages past the new end.
    path = write_tokens(tmp_path / "train.bin", np.arange(1 << 16) % 250)
    code = (f"from hetlaunch.runtime.data import open_data\n"
            f"import os\n"
            f"train, held = open_data({str(path)!r}, {data_format!r}, 'uint16', 8, 0, 256, 0.1)\n"
            f"train.batch(0, 16)\n"
            f"os.truncate({str(path)!r}, 64)\n"
            f"for data in (train, held):\n"
            f"    try:\n"
            f"        data.batch(1, 16)\n"
            f"    except ValueError as err:\n"
            f"        print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=hetlaunch_env(), timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all("shrank from 131072 to 64 bytes while training" in line for line in lines), done.stdout
    assert "held-out" in lines[1]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A small byte-level BPE trained here (the hub is not reachable from tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = open(json.__file__).read()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.timeout(240)
def test_prepare_data_then_train_on_the_tokens(tmp_path, tokenizer_json):
    from tokenizers import Tokenizer

    text = open(json.__file__).read() + "\nünïcødé ✓ at a chunk's edge\n" + "é✓" * 90 + "\n"  # a line longer than a chunk
    source = tmp_path / "input.txt"
    source.write_text(text)
    out = tmp_path / "train.bin"
    # A tiny chunk size, so lines and multi-byte characters are cut across chunks.
    code = ("import sys; import hetlaunch.launcher.prepare_data as p; p.CHUNK_BYTES = 97; "
            "from hetlaunch.launcher.cli import main; sys.argv = ['hetlaunch'] + sys.argv[1:]; main()")
    result = subprocess.run([sys.executable, "-c", code, "prepare-data", str(source), "--tokenizer", str(tokenizer_json),
                             "-o", str(out)], capture_output=True, text=True, timeout=120, env=hetlaunch_env())
    assert result.returncode == 0, result.stderr
    assert "format: tokens" in result.stdout and "dtype: uint16" in result.stdout
    ids = np.fromfile(out, dtype=np.uint16)
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    assert tokenizer.decode(ids.tolist()) == text  # nothing lost or doubled at the chunk edges
    assert not list(tmp_path.glob(".train.bin.*"))  # no temp file left

    vocab = tokenizer.get_vocab_size()
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(f"""name: tokens
model: {{preset: tiny, vocab_size: {vocab}, seq_len: 16, d_model: 32, n_layers: 2}}
data: {{format: tokens, path: {out}, dtype: uint16}}
train: {{steps: 4, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: b, device: cpu, threads: 1, layers: [2, 4]}}
""")
    run = run_hetlaunch("up", str(yaml_path), "--run-dir", str(tmp_path / "run"), timeout=180)
    assert run.returncode == 0, run.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and abs(losses[0] - np.log(vocab)) < 0.5  # a real vocabulary, not bytes


def test_prepare_data_errors_are_one_line(tmp_path, tokenizer_json):
    def prepare(*args, env=None):
        return subprocess.run(hetlaunch_cmd("prepare-data", *args), capture_output=True, text=True, timeout=60,
                              env=env or hetlaunch_env())

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\xfe not utf-8\n")
    result = prepare(str(bad), "--tokenizer", str(tokenizer_json), "-o", str(tmp_path / "o.bin"))
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "not UTF-8" in result.stderr
    assert not (tmp_path / "o.bin").exists() and not list(tmp_path.glob(".o.bin.*"))
    not_json = tmp_path / "tok.json"
    not_json.write_text("{ nope")
    result = prepare(str(bad), "--tokenizer", str(not_json), "-o", str(tmp_path / "o.bin"))
    assert result.returncode == 2 and "is not a tokenizer.json" in result.stderr
    result = prepare(str(tmp_path / "missing.txt"), "--tokenizer", str(tokenizer_json), "-o", str(tmp_path / "o.bin"))
    assert result.returncode == 2 and "is not a readable file" in result.stderr
    # Without the optional extra: the install line, not a traceback.
    code = ("import sys; sys.modules['tokenizers'] = None; from hetlaunch.launcher.cli import main; "
            "sys.argv = ['hetlaunch'] + sys.argv[1:]; main()")
    result = subprocess.run([sys.executable, "-c", code, "prepare-data", str(bad), "--tokenizer", "x", "-o",
                             str(tmp_path / "o.bin")], capture_output=True, text=True, timeout=60, env=hetlaunch_env())
    assert result.returncode == 2 and "pip install 'hetlaunch[data]'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_prepare_data_never_waits_on_or_replaces_what_is_not_a_regular_file(tmp_path, tokenizer_json):
    """A FIFO as the tokenizer hung; /dev/zero grew to 23 GB; -o naming a device replaced the device."""
    source = tmp_path / "corpus.txt"
    source.write_text("hello world\n" * 50)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for tokenizer in (fifo, "/dev/zero"):
        result = run_hetlaunch("prepare-data", str(source), "--tokenizer", str(tokenizer), "-o",
                               str(tmp_path / "o.bin"), timeout=60)
        assert result.returncode == 2 and result.stderr == f"error: {tokenizer}: not a regular file\n", result.stderr
    device = tmp_path / "null"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    result = run_hetlaunch("prepare-data", str(source), "--tokenizer", str(tokenizer_json), "-o", str(device), timeout=60)
    assert result.returncode == 2 and result.stderr == f"error: {device} exists and is not a regular file\n"
    assert stat.S_ISCHR(os.stat(device).st_mode)


def test_up_on_a_token_file_with_an_id_past_the_vocabulary_refuses_before_starting(tmp_path):
    path = write_tokens(tmp_path / "train.bin", [5] * 2000 + [9000] * 10, "uint16")
    (tmp_path / "c.yaml").write_text(f"""name: bad-ids
model: {{preset: tiny, n_layers: 1, d_model: 16, seq_len: 16}}
data: {{format: tokens, path: {path}}}
train: {{steps: 400, micro_batch_size: 4, num_microbatches: 1, checkpoint_every: 0}}
nodes:
  - {{name: a, device: cpu, threads: 1}}
""")
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"error: {tmp_path / 'c.yaml'}: data.path: {path} holds token id 9000, "
                                          "outside the model's vocabulary of 256 (ids 0..255), at position 2000 of 2010"]
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.timeout(180)
def test_the_stages_check_an_entrypoint_models_vocabulary_before_the_first_step(tmp_path):
    # `up` never imports the entrypoint (the coordinator runs without torch): the stage that opens
    # the file checks every id before training, so the bad one at the very end is found at once.
    path = write_tokens(tmp_path / "train.bin", [5] * 3000 + [9000], "uint16")
    (tmp_path / "c.yaml").write_text(f"""name: bad-ids
model: {{entrypoint: user_model:make_mlp_lm, kwargs: {{seq_len: 16, vocab_size: 256, d: 16, n_hidden: 1}}}}
data: {{format: tokens, path: {path}}}
train: {{steps: 400, micro_batch_size: 4, num_microbatches: 1, checkpoint_every: 0}}
nodes:
  - {{name: a, device: cpu, threads: 1}}
""")
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run"), timeout=150)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.bin' holds token id 9000, outside the model's vocabulary of 256 (ids 0..255), " \
                                "at position 3000 of 3001" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # not one step trained


@pytest.mark.timeout(180)
@pytest.mark.parametrize("held_out", [False, True])
def test_an_id_past_a_model_that_names_no_vocabulary_is_named_in_the_error(tmp_path, held_out):
    # Nothing checks the ids of a model without vocab_size before training: the first layer's
    # IndexError ends the run, and it must say which ids it was given (it said only "index out
    # of range in self").
    # held_out: the bad ids only in the held-out tail, evaluated after the step (a path of its own)
    path = write_tokens(tmp_path / "train.bin", [5] * 2700 + [9000] * 300 if held_out else [9000] * 3000, "uint16")
    evaluation = ", eval_every: 1, eval_in_bubbles: false" if held_out else ""
    (tmp_path / "c.yaml").write_text(f"""name: bad-ids
model: {{entrypoint: user_model:make_mlp_lm, kwargs: {{seq_len: 16, d: 16, n_hidden: 1}}}}
data: {{format: tokens, path: {path}}}
train: {{steps: 400, micro_batch_size: 4, num_microbatches: 1, checkpoint_every: 0{evaluation}}}
nodes:
  - {{name: a, device: cpu, threads: 1}}
""")
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run"), timeout=150)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "IndexError: index out of range in self (in the first stage's layers, on a batch " \
                                "of token ids up to 9,000: is an id at or past the model's vocabulary?" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_32_bit_file_of_a_16_bit_vocabulary_read_as_16_bit_is_named_too(tmp_path):
    """GPT-2's 50,257 ids written as uint32 and read as uint16: every other id is a high half of 0,
    all below the vocabulary, and the check said "every id below" (the test above held only past
    65,536; a review). A real uint16 file of the same vocabulary passes."""
    rng = np.random.default_rng(1)
    wide = write_tokens(tmp_path / "wide.bin", rng.integers(1, 50_257, size=20_000), "uint32")
    with pytest.raises(ValueError, match="looks like a uint32 token file read as uint16"):
        open_data(str(wide), "tokens", "uint16", seq_len=8, seed=0, vocab_size=50_257)
    narrow = write_tokens(tmp_path / "narrow.bin", rng.integers(0, 50_257, size=20_000), "uint16")
    open_data(str(narrow), "tokens", "uint16", seq_len=8, seed=0, vocab_size=50_257)


@pytest.mark.timeout(60)
def test_a_token_file_cut_shorter_while_checked_is_one_line_not_a_bus_error(tmp_path):
    """The check read ids through the memory map: a file truncated under it killed `validate` with
    SIGBUS (a review). Now read through the file, a short read is an error. In a child process,
    so the old way's signal fails this test instead of the test run."""
    path = write_tokens(tmp_path / "t.bin", np.arange(3 * (1 << 16)) % 1000)
    code = ("import os, sys\n"
            "import hetlaunch.runtime.token_file as tf\n"
            "tf.CHUNK_TOKENS = 1 << 16\n"
            f"tokens = tf.token_file({str(path)!r}, 'uint16')\n"
            f"os.truncate({str(path)!r}, 4096)\n"
            "try:\n"
            "    tf.check_token_ids(tokens, 1000, 'data file')\n"
            "except ValueError as err:\n"
            "    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "shrank while its ids were checked: 2,048 of 196,608 tokens left" in done.stdout, done.stdout


@pytest.mark.timeout(90)
def test_validate_checks_the_default_text_against_a_vocabulary_under_a_byte(tmp_path):
    """Without data.path the stages read the standard library's text a byte a token; validate said
    ok to vocab_size 100 and every stage refused its first byte past 99 (a review)."""
    (tmp_path / "c.yaml").write_text("name: t\nmodel: {preset: tiny, vocab_size: 100}\nnodes: [{name: a}]\n")
    result = run_hetlaunch("validate", str(tmp_path / "c.yaml"), timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "without data.path, the standard library's text holds token id" in result.stderr, result.stderr
    assert "outside the model's vocabulary of 100" in result.stderr and result.stderr.strip().endswith("set data.path")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    (tmp_path / "c.yaml").write_text("name: t\nmodel: {preset: tiny, vocab_size: 256}\nnodes: [{name: a}]\n")
    ok = run_hetlaunch("validate", str(tmp_path / "c.yaml"), timeout=60)
    assert ok.returncode == 0, ok.stderr
