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

Then the launcher's streams: ``batch_stream`` (packed documents or synthetic batches, from a position on: what a
checkpoint resumes), ``eval_batches`` (the fixed evaluation set) and ``lay_out`` (each batch's layout).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from cp_packing._checks import IGNORE_INDEX

__all__ = ["DATA_SUFFIXES", "Documents", "batch_stream", "eval_batches", "lay_out", "load_documents", "read_rows",
           "synthetic_batch"]

DATA_SUFFIXES = (".jsonl", ".parquet")


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
        rows = _jsonl_rows(path)
    if not rows:
        raise ValueError(f"--data {path!r} has no rows")
    return rows


def _jsonl_rows(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a byte-order mark may open the file
            except UnicodeDecodeError as exc:
                raise ValueError(f"--data {path!r} line {line_no} is not UTF-8 (byte {raw[exc.start]:#04x} at column "
                                 f"{exc.start + 1}); JSON lines are UTF-8: convert the file, e.g. iconv -f latin1 -t "
                                 "utf-8") from None
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


# --------------------------------------------------------------------------------------------- the launcher's streams
# What ``python -m cp_packing train`` feeds its steps: every rank computes the same stream (so a micro-batch's place
# in it, an int, is the data position a checkpoint stores), and ``lay_out`` picks and applies each batch's layout.


def synthetic_batch(args, step: int, dp_rank: int, *, stream: str = "train") -> dict:
    """The ``[B, S]`` batch of one DP replica at micro-batch ``step`` of ``stream`` (``"train"`` or ``"eval"``: a
    stream of its own): ``{"doc_ids", "input_ids", "labels"}`` (labels shifted on the global stream). Every document
    is an arithmetic progression of token ids (mod V) with its own start and stride, so the loss has a pattern to
    learn; lognormal lengths of median ``args.mean_doc_len`` (sigma ``args.doc_len_sigma``), up to 10% row padding."""
    import torch

    from cp_packing.loss import next_token_labels
    from cp_packing.testing import synthetic_doc_ids

    seed = args.seed * 1_000_003 + step * 1009 + dp_rank + (2**40 if stream == "eval" else 0)
    B, S, V = args.batch, args.seq_len, args.vocab
    doc = synthetic_doc_ids("lognormal", B, S, seed=seed, median=args.mean_doc_len, sigma=args.doc_len_sigma,
                            pad=0.1)
    flat = doc.reshape(-1)
    t = torch.arange(B * S)
    is_start = torch.ones(B * S, dtype=torch.bool)
    is_start[1:] = (flat[1:] != flat[:-1]) | (t[1:] % S == 0)
    seg = torch.cumsum(is_start, 0) - 1  # [T] segment of every token
    seg_start = t[is_start]
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, V, (seg_start.numel(),), generator=g)
    stride = torch.randint(1, 8, (seg_start.numel(),), generator=g)
    ids = ((start[seg] + stride[seg] * (t - seg_start[seg])) % V).where(flat != 0, 0).view(B, S)
    return {"doc_ids": doc, "input_ids": ids, "labels": next_token_labels(ids, doc)}


def batch_stream(args, data: Documents | None, dp_size: int, *, start: int = 0):
    """Micro-batches of ``dp_size`` replica batches from position ``start`` on: packed ``data`` documents (epoch
    after epoch, each packed with its own seed ``args.seed + epoch``), or synthetic batches. The same on every rank;
    position ``k`` is always the same micro-batch, so resuming at ``start`` continues the stream exactly.

    TODO(loader): a ``--data`` stream is skipped to ``start`` by re-packing (deterministic, but O(start)); use
    ``cp_packing.loader.cp_dataloader``'s ``state_dict()`` / ``load_state_dict()`` once it has them.

    >>> import argparse
    >>> args = argparse.Namespace(seed=0, batch=1, seq_len=8, vocab=16, mean_doc_len=3.0, doc_len_sigma=1.0)
    >>> third = next(batch_stream(args, None, 1, start=2))[0]["input_ids"]
    >>> stream = batch_stream(args, None, 1)
    >>> _, _ = next(stream), next(stream)
    >>> bool((next(stream)[0]["input_ids"] == third).all())  # position 2 is position 2, resumed or not
    True
    """
    if data is None:
        step = start
        while True:
            yield [synthetic_batch(args, step, r) for r in range(dp_size)]
            step += 1
    from cp_packing.packing import pack_documents

    epoch, position = 0, 0
    while True:
        empty = True
        for step in pack_documents(data.documents, seq_len=args.seq_len, rows=args.batch, dp_size=dp_size,
                                   seed=args.seed + epoch, drop_last=True):  # every step [batch, seq_len]
            empty = False
            if position >= start:
                yield step
            position += 1
        if empty:
            return
        epoch += 1


def eval_batches(args, data: Documents | None, dp_size: int) -> list:
    """The fixed evaluation set: ``args.eval_steps`` micro-batches of ``dp_size`` replica batches, the first steps
    of ``--eval-data`` packed with seed ``args.seed`` (fewer when it holds fewer), or of the synthetic eval stream."""
    if data is None:
        return [[synthetic_batch(args, i, r, stream="eval") for r in range(dp_size)] for i in range(args.eval_steps)]
    from cp_packing.packing import pack_documents

    out = []
    for step in pack_documents(data.documents, seq_len=args.seq_len, rows=args.batch, dp_size=dp_size,
                               seed=args.seed, drop_last=True):
        if len(out) == args.eval_steps:
            break
        out.append(step)
    return out


def lay_out(batch: dict, args, cp: int) -> tuple[dict, str]:
    """``(batch, layout)``: the layout this batch is sharded with (``args.layout``, or ``auto`` among
    ``args.layouts``, the backend's: the library's per-batch ``auto`` when the backend runs them all, else the one of
    lowest busiest-rank cost), and the batch padded to multiples of ``2*cp`` per document for zigzag (pad tokens:
    label -100). Adds ``"real"``: False on padding and pad tokens."""
    import torch

    from cp_packing.cost import layout_cost
    from cp_packing.layouts import LAYOUTS

    layout = args.layout
    if layout == "auto" and set(args.layouts) != set(LAYOUTS):
        costs = {}
        for name in args.layouts:
            try:
                costs[name] = layout_cost(batch["doc_ids"], cp_size=cp, layout=name,
                                          window=getattr(args, "windows", None)).busiest_cost
            except ValueError:  # contiguous / balanced on a batch not divisible by cp
                pass
        layout = min(costs, key=costs.__getitem__)
    doc = batch["doc_ids"].to(torch.int64)
    out = {"doc_ids": doc, "input_ids": batch["input_ids"], "labels": batch["labels"], "real": doc != 0}
    if layout == "zigzag":
        from cp_packing.padding import pad_segments

        padded = pad_segments(doc, multiple=2 * cp, tensors={"input_ids": out["input_ids"], "labels": out["labels"]})
        out = {"doc_ids": padded.doc_ids, "input_ids": padded.tensors["input_ids"],
               "labels": padded.tensors["labels"], "real": ~padded.is_pad & (padded.doc_ids != 0)}
    return out, layout
