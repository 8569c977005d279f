"""Local datasets for ``python -m cp_packing train --data PATH``: a ``.jsonl`` or ``.parquet`` file, one document
per row, read into the documents ``cp_packing.packing.pack_documents`` packs.

A row holds either
- ``text``: a string, tokenized with the tokenizer of the model directory (``add_special_tokens=True``, then the
  tokenizer's end-of-sequence token appended when it has one and the text does not already end with it), or
- ``input_ids``: a list of token ids, with an optional ``labels`` list of the same length (unshifted, HF style:
  each entry the input id itself, or ``-100`` where that token is not a target, e.g. a prompt); the packer
  shifts them on the global stream.

Every problem (a missing file, another suffix, a row that is not an object, a missing or mistyped column, an id
outside the vocabulary) is a ``ValueError`` naming the file, the row and the fix; the launcher turns it into a
usage error (exit 2) before the first step. Rows whose text tokenizes to nothing are skipped and counted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DATA_SUFFIXES", "Documents", "load_documents", "read_rows"]

DATA_SUFFIXES = (".jsonl", ".parquet")
IGNORE_INDEX = -100


@dataclass
class Documents:
    """What ``load_documents`` read.

    Attributes:
        documents: one entry per document: a list of token ids, or ``{"input_ids": [...], "labels": [...]}`` when
            the file has a ``labels`` column.
        column: the column the tokens came from (``"text"`` or ``"input_ids"``).
        skipped: rows skipped because their text tokenized to no tokens.
        tokens: the total number of tokens.
    """

    documents: list = field(default_factory=list)
    column: str = ""
    skipped: int = 0
    tokens: int = 0


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` (one JSON object per line; blank lines skipped) or ``.parquet`` file, as dicts.

    Raises:
        ValueError: a missing file, another suffix, an unreadable file, a line that is not a JSON object, no rows.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "d.jsonl")
    >>> _ = open(path, "w").write('{"text": "a b"}\\n\\n{"text": "c"}\\n')
    >>> read_rows(path)
    [{'text': 'a b'}, {'text': 'c'}]
    """
    if not os.path.isfile(path):
        raise ValueError(f"--data {path!r} does not exist or is not a file; give a local .jsonl or .parquet file")
    if not path.endswith(DATA_SUFFIXES):
        raise ValueError(f"--data {path!r}: unknown format; give a .jsonl file (one JSON object per line) or a "
                         ".parquet file, each row with a 'text' or an 'input_ids' column")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        except ImportError:
            raise ValueError("--data: reading .parquet needs pyarrow (pip install pyarrow); or give a .jsonl "
                             "file") from None
        except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... on a corrupt file
            raise ValueError(f"--data {path!r} is not a readable parquet file ({type(exc).__name__}: {exc})") from None
    else:
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"--data {path!r} line {line_no} is not JSON ({exc.msg}); a .jsonl file holds "
                                     "one JSON object per line") from None
                if not isinstance(row, dict):
                    raise ValueError(f"--data {path!r} line {line_no} holds a {type(row).__name__}, not an object "
                                     'such as {"text": "..."} or {"input_ids": [1, 2, 3]}')
                rows.append(row)
    if not rows:
        raise ValueError(f"--data {path!r} has no rows")
    return rows


def _id_list(value: Any, path: str, row: int, column: str, low: int, vocab_size: int | None) -> list[int]:
    """``value`` as a list of ints in ``[low, vocab_size)`` (``low`` = -100 allows the ignore index for labels)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"--data {path!r} row {row}: {column!r} must be a list of integers, got "
                         f"{type(value).__name__}")
    wrong = sorted({type(v).__name__ for v in value if not isinstance(v, int) or isinstance(v, bool)})
    if wrong:
        raise ValueError(f"--data {path!r} row {row}: {column!r} must be a list of integers, got a list with {wrong}")
    for v in value:
        bad = v < 0 and not (low == IGNORE_INDEX and v == IGNORE_INDEX)
        if bad or (vocab_size is not None and v >= vocab_size):
            raise ValueError(f"--data {path!r} row {row}: {column!r} holds {v}, outside the model's vocabulary "
                             f"[0, {vocab_size})" + (" (or -100 for a masked label)" if low == IGNORE_INDEX else "")
                             + "; tokenize with the model's tokenizer")
    return list(value)


def _token_documents(rows: list[dict], path: str, vocab_size: int | None) -> Documents:
    out = Documents(column="input_ids")
    with_labels = "labels" in rows[0]
    for i, row in enumerate(rows):
        if "input_ids" not in row or ("labels" in row) != with_labels:
            need = "'input_ids' and 'labels'" if with_labels else "'input_ids' (and no 'labels')"
            raise ValueError(f"--data {path!r} row {i} has columns {sorted(row)}, the first row "
                             f"{sorted(rows[0])}; every row needs {need}")
        ids = _id_list(row["input_ids"], path, i, "input_ids", 0, vocab_size)
        if not ids:
            raise ValueError(f"--data {path!r} row {i}: 'input_ids' is empty; drop empty documents")
        if with_labels:
            labels = _id_list(row["labels"], path, i, "labels", IGNORE_INDEX, vocab_size)
            if len(labels) != len(ids):
                raise ValueError(f"--data {path!r} row {i}: 'labels' has {len(labels)} entries, 'input_ids' "
                                 f"{len(ids)}; they must match one to one (unshifted, -100 where masked)")
            wrong = next((t for t, (a, b) in enumerate(zip(ids, labels)) if b not in (a, IGNORE_INDEX)), None)
            if wrong is not None:
                raise ValueError(f"--data {path!r} row {i}: labels[{wrong}] = {labels[wrong]} is neither -100 nor "
                                 f"input_ids[{wrong}] = {ids[wrong]}; 'labels' are the unshifted input ids with -100 "
                                 "where a token is not a target (the launcher shifts them)")
            out.documents.append({"input_ids": ids, "labels": labels})
        else:
            out.documents.append(ids)
        out.tokens += len(ids)
    return out


def _text_documents(rows: list[dict], path: str, tokenizer: Any, vocab_size: int | None) -> Documents:
    for i, row in enumerate(rows):
        if not isinstance(row.get("text"), str):
            raise ValueError(f"--data {path!r} row {i}: 'text' must be a string, got "
                             f"{type(row.get('text')).__name__} (columns {sorted(row)})")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the launcher forks ranks after tokenizing
    encoded = tokenizer([row["text"] for row in rows], add_special_tokens=True)["input_ids"]
    eos = getattr(tokenizer, "eos_token_id", None)
    out = Documents(column="text")
    for i, ids in enumerate(encoded):
        ids = list(ids)
        if ids and eos is not None and ids[-1] != eos:
            ids.append(eos)  # a document ends where its end-of-sequence token says so
        if not ids or (len(ids) == 1 and ids[0] == eos):
            out.skipped += 1
            continue
        out.documents.append(_id_list(ids, path, i, "text (tokenized)", 0, vocab_size))
        out.tokens += len(ids)
    if not out.documents:
        raise ValueError(f"--data {path!r}: every row's text tokenized to nothing")
    return out


def load_documents(path: str, *, tokenizer: Any = None, vocab_size: int | None = None) -> Documents:
    """Read a local dataset into documents for the packer (module docstring: the formats).

    Args:
        path: a ``.jsonl`` or ``.parquet`` file.
        tokenizer: a HF tokenizer (needed for a ``text`` column; ``None``: token ids only).
        vocab_size: ids must lie in ``[0, vocab_size)`` (``None``: not checked).

    Returns:
        ``Documents``.

    Raises:
        ValueError: an unreadable file, rows with neither ``text`` nor ``input_ids``, a ``text`` column without a
            tokenizer, ids outside the vocabulary, labels of another length (names the row and the fix).

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "d.jsonl")
    >>> _ = open(path, "w").write('{"input_ids": [5, 6, 7]}\\n{"input_ids": [8]}\\n')
    >>> load_documents(path, vocab_size=10).documents
    [[5, 6, 7], [8]]
    """
    rows = read_rows(path)
    columns = sorted(rows[0])
    if "input_ids" in rows[0]:
        return _token_documents(rows, path, vocab_size)
    if "text" in rows[0]:
        if tokenizer is None:
            raise ValueError(f"--data {path!r} has a 'text' column but there is no tokenizer: give --model a HF "
                             "model directory that holds its tokenizer (tokenizer.json / tokenizer_config.json, "
                             "as save_pretrained writes them), or store token ids in an 'input_ids' column")
        return _text_documents(rows, path, tokenizer, vocab_size)
    raise ValueError(f"--data {path!r}: rows need a 'text' column (a string) or an 'input_ids' column (token ids, "
                     f"optional 'labels'); the first row has {columns}")
