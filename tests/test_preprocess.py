"""`train-ledger preprocess`: a .jsonl corpus -> Megatron's indexed dataset, checked by reading it back; bad input is
one line and exit 2 with nothing left behind; and (slow) preprocess -> `train --data-path` on gloo. The corpora are
synthetic: they test the plumbing."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cli.main import main
from cli.preprocess import BYTE_EOD
from engine.datasets.indexed_dataset import IndexedDataset
from tests.support.read_only import read_only_folder

TEXTS = ["hello", "", "wörld 🌍"]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_byte_level_documents_are_utf8_bytes_then_end_of_document(tmp_path, capsys):
    source = _jsonl(tmp_path / "c.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "c")]) == 0
    dataset = IndexedDataset(tmp_path / "c")
    assert dataset.dtype == np.uint16 and dataset.num_documents == len(TEXTS)
    assert [dataset[i].tolist() for i in range(len(TEXTS))] == [[*t.encode("utf-8"), BYTE_EOD] for t in TEXTS]
    out = capsys.readouterr().out
    tokens = sum(len(t.encode("utf-8")) + 1 for t in TEXTS)  # every byte and one end-of-document each
    assert f"wrote {tmp_path / 'c.bin'} and {tmp_path / 'c.idx'}: 3 documents, {tokens} tokens" in out
    assert "--vocab-size 257" in out


def test_counts_of_one_are_singular(tmp_path, capsys):
    source = _jsonl(tmp_path / "c.jsonl", [{"text": ""}])
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "c")]) == 0
    assert ": 1 document, 1 token;" in capsys.readouterr().out  # the end-of-document id alone


def test_json_key_picks_the_field(tmp_path):
    source = _jsonl(tmp_path / "c.jsonl", [{"text": "no", "body": "ab"}])
    prefix = str(tmp_path / "c")
    assert main(["preprocess", "--input", str(source), "--json-key", "body", "--output-prefix", prefix]) == 0
    assert IndexedDataset(tmp_path / "c")[0].tolist() == [97, 98, BYTE_EOD]


def test_a_tokenizer_json_with_end_of_document(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the optional extra `tokenizers` is not installed")
    vocab = {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    source = _jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}, {"text": "world what"}])
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "c"), "--tokenizer",
                 str(tmp_path / "tokenizer.json"), "--append-eod"]) == 0
    dataset = IndexedDataset(tmp_path / "c")
    assert [dataset[i].tolist() for i in range(2)] == [[2, 3, 1], [3, 0, 1]]
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "d"), "--tokenizer",
                 str(tmp_path / "tokenizer.json"), "--append-eod", "--eod-token", "</s>"]) == 2


@pytest.mark.parametrize("lines, flags, message", [
    (['{"text": "a"}', "{broken"], [], "line 2 is not JSON"),
    (['{"text": "a"}', '{"body": "b"}'], [], "line 2 has no string field 'text'"),
    (['{"text": 3}'], [], "line 1 has no string field 'text'"),
    (["", "  "], [], "holds no documents"),
    (['{"text": "a"}'], ["--tokenizer", "/no/such/tokenizer.json"], "tokenizer"),
    (['{"text": "a"}'], ["--append-eod"], "--append-eod goes with --tokenizer"),
])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, lines, flags, message):
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["preprocess", "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "c"),
                 *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("train-ledger preprocess: error: ") and message in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_a_binary_input_is_one_line_naming_the_line(tmp_path, capsys):
    """Random bytes are not a corpus: the first line that is not UTF-8 is named, nothing is written."""
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "a"}\n' + bytes(range(128, 256)) + b"\n")
    assert main(["preprocess", "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "c")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"train-ledger preprocess: error: {tmp_path / 'c.jsonl'}: line 2 is not UTF-8 text (a .jsonl " \
                   "corpus is text)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_an_unwritable_output_prefix_is_one_line(tmp_path, capsys):
    source = _jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    with read_only_folder(tmp_path) as folder:
        assert main(["preprocess", "--input", str(source), "--output-prefix", str(folder / "c")]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"train-ledger preprocess: error: {folder / 'c.bin'}: cannot be written ("), line
        assert list(folder.iterdir()) == []


def test_an_existing_dataset_is_never_overwritten(tmp_path, capsys):
    source = _jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "c")]) == 0
    before = (tmp_path / "c.bin").read_bytes(), (tmp_path / "c.idx").read_bytes()
    _jsonl(source, [{"text": "other"}])
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "c")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert ((tmp_path / "c.bin").read_bytes(), (tmp_path / "c.idx").read_bytes()) == before
    assert main(["preprocess", "--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "d")]) == 2


@pytest.mark.slow
def test_preprocess_then_train_on_gloo(tmp_path):
    """The newcomer's path: preprocess a small jsonl, train the tiny model 3 steps on 2 data-parallel ranks."""
    texts = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1) for i in range(40)]
    source = _jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "cli.main"]
    prep = subprocess.run(cli + ["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "c")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert prep.returncode == 0, prep.stderr
    train = subprocess.run(cli + ["train", "--nproc-per-node", "2", "--model", "tiny", "--data-path",
                                  str(tmp_path / "c"), "--split", "98,2,0", "--train-iters", "3",
                                  "--micro-batch-size", "1", "--global-batch-size", "4"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert train.returncode == 0, train.stderr
    losses = [float(line.split("lm loss:")[1].split("|")[0]) for line in train.stdout.splitlines() if "lm loss" in line]
    assert len(losses) == 3 and all(np.isfinite(losses))
