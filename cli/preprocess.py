"""`train-ledger preprocess --input FILE.jsonl --json-key text --output-prefix P [--tokenizer tokenizer.json]`:
a JSON-lines corpus -> Megatron's indexed dataset (P.bin + P.idx), one document per line, as Megatron-LM's
tools/preprocess_data.py writes it, so that `train --data-path P` (or Megatron itself) can train on it.

Without --tokenizer the text is tokenized as its UTF-8 bytes (ids 0..255) and every document ends with the
end-of-document id 256: a vocabulary of 257 that needs no file and no download. With --tokenizer, a local
Hugging Face `tokenizer.json` is read by the `tokenizers` package (the optional extra `tokenizers`); --append-eod then
ends each document with --eod-token. Torch is not imported.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

from cli.args import CommandParser
from common.errors import ConfigError, InputError
from common.run_dir import check_writable
from common.wording import plural

BYTE_EOD = 256  # the byte-level tokenizer's end-of-document id, after the 256 byte values
BYTE_VOCAB_SIZE = 257


def build_parser() -> CommandParser:
    p = CommandParser("preprocess")
    p.add_argument("--input", required=True, help="a .jsonl file: one JSON object per line")
    p.add_argument("--json-key", default="text", help="the field of each object that holds the document's text")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx (never overwritten)")
    p.add_argument("--tokenizer", help="a local tokenizer.json (needs the `tokenizers` package); default: bytes")
    p.add_argument("--append-eod", action="store_true", help="with --tokenizer: end each document with --eod-token")
    p.add_argument("--eod-token", default="<|endoftext|>", help="the end-of-document token of --tokenizer")
    return p


def byte_tokenizer() -> tuple[Callable[[str], list[int]], int]:
    return (lambda text: [*text.encode("utf-8"), BYTE_EOD]), BYTE_VOCAB_SIZE


def file_tokenizer(path: str, append_eod: bool, eod_token: str) -> tuple[Callable[[str], list[int]], int]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the `tokenizers` package (pip install 'train-ledger[tokenizers]'); "
                          "without --tokenizer the text is tokenized as bytes") from None
    if not Path(path).is_file():
        raise InputError(path, "no such tokenizer file")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the library raises its own Exception type for any unreadable file
        raise InputError(path, f"not a tokenizer.json ({str(exc).splitlines()[0] if str(exc) else exc!r})") from None
    eod = tokenizer.token_to_id(eod_token) if append_eod else None
    if append_eod and eod is None:
        raise ConfigError(f"--eod-token {eod_token!r} is not in the vocabulary of {path}")
    tail = [eod] if eod is not None else []
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids + tail), tokenizer.get_vocab_size()


def documents(path: Path, key: str) -> Iterator[str]:
    """The text of every line's `key`; any line that is not a JSON object holding a string there is an InputError."""
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(path, f"line {number} is not UTF-8 text (a .jsonl corpus is text)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(path, f"line {number} is not JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise InputError(path, f"line {number} has no string field {key!r} (--json-key)")
            yield record[key]


def main(argv: list[str]) -> int:
    from engine.datasets.indexed_dataset import IndexedDatasetWriter, bin_path, idx_path, optimal_dtype

    args = build_parser().parse_args(argv)
    source = Path(args.input)
    if not source.is_file():
        raise InputError(source, "no such input file")
    for existing in (idx_path(args.output_prefix), bin_path(args.output_prefix)):
        if existing.exists():
            raise InputError(existing, "already exists; choose another --output-prefix")
    if not Path(args.output_prefix).parent.is_dir():
        raise InputError(Path(args.output_prefix).parent, "no such output directory")
    check_writable(bin_path(args.output_prefix))
    if args.tokenizer is None and args.append_eod:
        raise ConfigError("--append-eod goes with --tokenizer (the byte-level tokenizer always ends documents)")
    encode, vocab_size = (file_tokenizer(args.tokenizer, args.append_eod, args.eod_token) if args.tokenizer
                          else byte_tokenizer())
    writer = IndexedDatasetWriter(args.output_prefix, optimal_dtype(vocab_size))
    try:
        for text in documents(source, args.json_key):
            writer.add_document(encode(text))
    except BaseException:
        writer.discard()
        raise
    if not writer.lengths:
        writer.discard()
        raise InputError(source, "holds no documents")
    writer.finalize()
    documents_, tokens = len(writer.lengths), sum(writer.lengths)
    print(f"wrote {bin_path(args.output_prefix)} and {idx_path(args.output_prefix)}: "
          f"{plural(documents_, 'document')}, {plural(tokens, 'token')}; "
          f"train with --data-path {args.output_prefix} --vocab-size {vocab_size} (or larger)")
    return 0
