"""Neat packing of tokenized documents into fixed-shape steps, balanced across data-parallel replicas.

``pack_documents(documents, seq_len=, rows=, dp_size=)`` turns a stream of tokenized documents into *steps*. A step
is a list of ``dp_size`` dicts, one per DP replica, each ``{"input_ids", "labels", "doc_ids"}`` of shape
``[rows, seq_len]``: the global batch a replica's CP group shards (``doc_ids`` is the 1-based doc map,
``labels`` are already shifted on the global stream as :func:`cp_packing.next_token_labels` shifts them).

A step is formed in rounds over a buffer of ``buffer_tokens`` tokens: fill it, count the full steps by
best-fit-decreasing (``form_steps``), pack them for balance of the causal attention work ``sum L(L + 1) / 2`` per
replica (``balanced_pack``, then ``polish_step``), carry the rest, emit in an order shuffled by ``seed``. Every
token of every document is yielded exactly once (``truncate`` and ``drop_last`` drop what they say, counted). The
rounds, the labels, the bounded polish, resuming (``DocumentPacker.state_dict``) and the benchmark:
docs/packing.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import logging
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from cp_packing._checks import (
    IGNORE_INDEX,
    INT32_MAX,
    INTEGER_DTYPES,
    check_bool,
    check_choice,
    check_int,
    check_number,
)

__all__ = ["LONG_DOCUMENTS", "DocumentPacker", "PackingStats", "default_buffer_tokens", "pack_documents"]

logger = logging.getLogger("cp_packing")

#: What ``pack_documents`` does with a document longer than ``seq_len``.
LONG_DOCUMENTS = ("split", "truncate", "error")

_KEY = 1 << 32  # best-fit keys: room * _KEY + row (rows < 2**32)
_STATE_VERSION = 1
_logged: set[str] = set()  # notices given once per process


def _log_once(key: str, message: str, *args: Any) -> None:
    """``logger.warning`` the first time ``key`` is seen in this process, ``logger.debug`` afterwards (a packer per
    epoch must not repeat the same notice every epoch)."""
    if key in _logged:
        logger.debug(message, *args)
    else:
        _logged.add(key)
        logger.warning(message + " (logged once per process)", *args)


def default_buffer_tokens(seq_len: int, rows: int, dp_size: int = 1) -> int:
    """The packer's default buffer: eight steps of tokens (``8 * rows * dp_size * seq_len``), at least ``2**22``.

    Measured (docs/packing.md): fill within 0.5 points of first-fit-decreasing over all documents on short, chat and
    long mixes; DP balance improves with the buffer (more steps per round to spread the costliest pieces over).
    Memory: the held tokens (int32 where the ids fit, else int64).

    >>> default_buffer_tokens(8192, 4, 8), default_buffer_tokens(32768, 4, 32)
    (4194304, 33554432)
    """
    return max(8 * rows * dp_size * seq_len, 2**22)


@dataclass
class PackingStats:
    """What the packer has done so far; updated as steps are yielded.

    Attributes:
        seq_len: the row length.
        documents: source documents read.
        steps: steps yielded.
        rows: rows yielded, over all replicas (empty rows of a step the buffer could not fill included).
        empty_rows: rows yielded that hold only padding.
        tokens: real (document) tokens yielded.
        split_documents: documents longer than ``seq_len`` split into pieces (``long_documents="split"``).
        split_pieces: the pieces those documents were split into.
        truncated_documents, truncated_tokens: documents cut to ``seq_len`` and the tokens cut off (``"truncate"``).
        dropped_documents, dropped_tokens: documents (or pieces of them) and tokens of the last step that
            ``drop_last=True`` did not yield.
        step_imbalance: per yielded step, the busiest replica's cost over the mean replica cost (1.0 is perfect).
    """

    seq_len: int
    documents: int = 0
    steps: int = 0
    rows: int = 0
    empty_rows: int = 0
    tokens: int = 0
    split_documents: int = 0
    split_pieces: int = 0
    truncated_documents: int = 0
    truncated_tokens: int = 0
    dropped_documents: int = 0
    dropped_tokens: int = 0
    step_imbalance: list[float] = field(default_factory=list)

    @property
    def fill(self) -> float:
        """Real tokens / all token slots yielded (``rows * seq_len``); 1.0 before any row."""
        return self.tokens / (self.rows * self.seq_len) if self.rows else 1.0

    @property
    def max_imbalance(self) -> float:
        """The largest per-step busiest / mean replica cost so far (1.0 before any step)."""
        return max(self.step_imbalance, default=1.0)


@dataclass
class _Doc:
    """A source document held in the buffer until all its tokens are yielded."""

    index: int  # position in the source
    ids: np.ndarray  # int64 [L]
    keep: np.ndarray | None  # bool [L]: False where the caller's unshifted label is -100; None: all kept
    cursor: int = 0  # tokens already placed (split documents give their pieces in stream order)
    left: int = 0  # pieces not yet placed


def _check_buffer(buffer_tokens: Any, buffer_size: Any, step_tokens: int) -> tuple[int | None, int | None]:
    """``(buffer_tokens, buffer_size)``: the token bound (default :func:`default_buffer_tokens`; none when only the
    deprecated document count ``buffer_size`` is given) and the document bound (``None``: none)."""
    if buffer_size is not None:
        buffer_size = check_int(buffer_size, "buffer_size", min=1, hint="documents held at most (deprecated)")
        warnings.warn(
            "pack_documents(buffer_size=...) counts DOCUMENTS and is deprecated: a buffer of short documents may not "
            "hold one step, and the packer then yields steps with empty rows. Pass buffer_tokens= (tokens held at "
            "most; default max(8 * rows * dp_size * seq_len, 2**22)) instead; buffer_size alone keeps its old "
            "meaning (documents only) until it is removed",
            FutureWarning, stacklevel=4)
    if buffer_tokens is None:
        return (None if buffer_size is not None else default_buffer_tokens(step_tokens, 1)), buffer_size
    buffer_tokens = check_int(buffer_tokens, "buffer_tokens", hint="tokens held at most (default: eight steps)")
    if buffer_tokens < step_tokens:
        raise ValueError(
            f"buffer_tokens={buffer_tokens} holds less than one step (rows * dp_size * seq_len = {step_tokens} "
            f"tokens): every round must be able to fill a step; pass buffer_tokens >= {step_tokens} or leave it out "
            f"(default {default_buffer_tokens(step_tokens, 1)}: eight steps, at least 2**22)")
    return buffer_tokens, buffer_size


class DocumentPacker:
    """Iterator over packed, DP-balanced steps of tokenized documents; see :func:`pack_documents` (the same
    arguments) and docs/packing.md for how a step is formed. ``.stats`` (:class:`PackingStats`) is updated as
    steps are yielded. Resumable: :meth:`state_dict` / :meth:`load_state_dict` (torchdata's ``Stateful``
    protocol); :meth:`skip` advances without building tensors.

    >>> packer = DocumentPacker([[5, 6, 7], [8, 9], [3, 4, 5, 6]], seq_len=5, rows=1, dp_size=2)
    >>> [[d["doc_ids"].tolist() for d in step] for step in packer]
    [[[[1, 1, 1, 1, 0]], [[1, 1, 1, 2, 2]]]]
    >>> packer.stats.fill, packer.stats.steps
    (0.9, 1)
    """

    def __init__(
        self,
        documents: Iterable[Any],
        *,
        seq_len: int,
        rows: int,
        dp_size: int = 1,
        long_documents: str = "split",
        buffer_tokens: int | None = None,
        buffer_size: int | None = None,
        seed: int = 0,
        pad_token_id: int = 0,
        drop_last: bool = False,
        attention_weight: float = 1.0,
        token_weight: float = 0.0,
    ) -> None:
        self.seq_len = check_int(seq_len, "seq_len", min=1, hint="the row length in tokens")
        self.rows = check_int(rows, "rows", min=1, hint="rows per replica per step")
        self.dp_size = check_int(dp_size, "dp_size", min=1, hint="the number of data-parallel replicas")
        if self.rows * self.seq_len > INT32_MAX:
            raise ValueError(
                f"a replica batch of rows * seq_len = {self.rows} * {self.seq_len} = {self.rows * self.seq_len} "
                f"tokens is more than int32 cu_seqlens can index ({INT32_MAX}); pass a smaller seq_len or rows "
                f"(seq_len={self.seq_len} is a row length in tokens)")
        self.long_documents = check_choice(long_documents, "long_documents", LONG_DOCUMENTS)
        self.buffer_tokens, self.buffer_size = _check_buffer(buffer_tokens, buffer_size,
                                                             self.rows * self.dp_size * self.seq_len)
        self.seed = check_int(seed, "seed", min=0, hint="the packer's NumPy generator takes a seed >= 0, e.g. 0")
        self.pad_token_id = check_int(pad_token_id, "pad_token_id", min=0, max=2**63 - 1)
        self.drop_last = check_bool(drop_last, "drop_last")
        self.attention_weight = check_number(attention_weight, "attention_weight", min=0.0)
        self.token_weight = check_number(token_weight, "token_weight", min=0.0)
        if isinstance(documents, (str, bytes, dict)) or not hasattr(documents, "__iter__"):
            raise TypeError(f"documents must be an iterable of documents (lists of token ids, 1-D int tensors or dicts "
                            f"with 'input_ids'), got {type(documents).__name__}")
        self.stats = PackingStats(seq_len=self.seq_len)
        self._source = iter(documents)
        self._exhausted = False  # the source has no document left
        self._done = False  # every round has run
        self._held: dict[int, _Doc] = {}  # source index -> document with tokens not yet yielded
        self._held_tokens = 0  # their tokens not yet yielded
        self._carry: list[tuple[int, int]] = []  # (length, source index) pieces carried to the next round
        self._pending: deque = deque()  # the current round's steps not yet yielded
        self._rng = np.random.default_rng(self.seed)

    def __iter__(self) -> DocumentPacker:
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        return self._emit(self._next_step(), build=True)

    def _next_step(self) -> list[list[list[tuple[int, int]]]]:
        while not self._pending:
            if self._done:
                raise StopIteration
            self._round()
        return self._pending.popleft()

    def skip(self, n: int) -> int:
        """Advance past the next ``n`` steps without building their tensors (stats are counted as if yielded).

        Returns:
            The steps skipped (fewer than ``n`` when the documents run out).
        """
        n = check_int(n, "n", min=0)
        for k in range(n):
            try:
                self._emit(self._next_step(), build=False)
            except StopIteration:
                return k
        return n

    # ------------------------------------------------------------------------------------------------------------
    # reading

    def _read(self) -> list[tuple[int, int]]:
        """Read documents while the held ones have fewer than ``buffer_tokens`` tokens (and, with the deprecated
        ``buffer_size``, fewer than that many documents); return the new pieces ``(length, source index)``."""
        pieces: list[tuple[int, int]] = []
        tokens, docs = self.buffer_tokens, self.buffer_size
        while not self._exhausted and (tokens is None or self._held_tokens < tokens) and (
                docs is None or len(self._held) < docs):
            try:
                raw = next(self._source)
            except StopIteration:
                self._exhausted = True
                break
            index = self.stats.documents
            self.stats.documents += 1
            ids, keep = _as_document(raw, index)
            if int(ids.max()) <= INT32_MAX:  # held in half the memory (written to int64 input_ids at emit)
                ids = ids.astype(np.int32)
            n = ids.size
            lengths = [n]
            if n > self.seq_len:
                if self.long_documents == "error":
                    raise ValueError(
                        f"document {index} has {n} tokens, more than seq_len={self.seq_len}; pass "
                        f"long_documents='split' (pieces in separate rows) or 'truncate', or raise seq_len")
                if self.long_documents == "truncate":
                    self.stats.truncated_documents += 1
                    self.stats.truncated_tokens += n - self.seq_len
                    ids, lengths = ids[: self.seq_len], [self.seq_len]
                    keep = None if keep is None else keep[: self.seq_len]
                else:
                    lengths = [self.seq_len] * (n // self.seq_len) + ([n % self.seq_len] if n % self.seq_len else [])
                    self.stats.split_documents += 1
                    self.stats.split_pieces += len(lengths)
            self._held[index] = _Doc(index, ids, keep, left=len(lengths))
            self._held_tokens += ids.size
            pieces.extend((length, index) for length in lengths)
        return pieces

    # ------------------------------------------------------------------------------------------------------------
    # rounds

    def _round(self) -> None:
        """One round: read, count the steps, pack them, queue them in ``_pending`` (shuffled by ``seed``)."""
        pieces = self._carry + self._read()
        self._carry = []
        if not pieces:
            self._done = True
            return
        step_rows = self.rows * self.dp_size
        rows = [[pieces[i] for i in row] for row in best_fit_decreasing([p[0] for p in pieces], self.seq_len)]
        rows.sort(key=lambda row: -sum(p[0] for p in row))  # fullest first (stable)
        n_full = len(rows) // step_rows
        if not self._exhausted:  # only as many steps as the tokens fill: the least-full rows wait for new documents
            n_full = min(n_full, sum(p[0] for p in pieces) // (step_rows * self.seq_len))
            if n_full == 0:  # only with the deprecated buffer_size: it cannot hold a step
                _log_once("small-buffer", "pack_documents: buffer_size=%d documents fill only %d of the %d rows of a "
                          "step (rows * dp_size); yielding steps with empty rows: pass buffer_tokens= instead",
                          self.buffer_size, len(rows), step_rows)
                rows += [[] for _ in range(step_rows - len(rows))]
                n_full = 1
        steps, rest = self._steps_of(pieces, rows, n_full)
        self._pending.extend(steps[i] for i in self._rng.permutation(len(steps)))
        if not self._exhausted:
            self._carry = [p for row in rest for p in row]
            return
        if rest:  # the last, smaller step
            k_last = -(-len(rest) // self.dp_size)
            rest += [[] for _ in range(k_last * self.dp_size - len(rest))]
            last = self._balance(rest, 1, k_last)[0]
            if self.drop_last:
                self._drop(last)
            else:
                self._pending.append(last)
        self._done = True

    def _steps_of(self, pieces: list[tuple[int, int]], rows: list[list[tuple[int, int]]], n_full: int):
        """``n_full`` steps from a round's pieces, and the rows left over (best-fit rows of the rest).

        Balanced packing (``balanced_pack``) when it is as full as best fit (the pieces it leaves need no more
        rows, or, mid-stream, no more tokens, than the best-fit rows left over); else the fullest best-fit rows
        dealt to replicas (``form_steps``). Either way each step is polished (``polish_step``).
        """
        step_rows = self.rows * self.dp_size
        rest = rows[n_full * step_rows:]
        if n_full and self.dp_size > 1:
            packed, left = balanced_pack(pieces, n_steps=n_full, dp_size=self.dp_size, per_replica=self.rows,
                                         seq_len=self.seq_len)
            left_rows = [[left[i] for i in row] for row in best_fit_decreasing([p[0] for p in left], self.seq_len)]
            if self._exhausted:
                as_full = len(left_rows) <= len(rest)
            else:
                as_full = sum(p[0] for p in left) <= sum(p[0] for row in rest for p in row)
            if as_full:
                return self._polished(packed), left_rows
        return self._balance(rows[:n_full * step_rows], n_full, self.rows), rest

    def _row_costs(self, rows: list[list[tuple[int, int]]]) -> np.ndarray:
        """float64 ``[R]``: ``attention_weight * sum L(L+1)/2`` (segments and the padding run) plus
        ``token_weight * S``."""
        costs = np.empty(len(rows), dtype=np.float64)
        for r, row in enumerate(rows):
            pad = self.seq_len - sum(p[0] for p in row)
            costs[r] = sum(p[0] * (p[0] + 1) // 2 for p in row) + pad * (pad + 1) // 2
        return self.attention_weight * costs + self.token_weight * self.seq_len

    def _balance(self, rows: list[list[tuple[int, int]]], n_steps: int, k: int) -> list:
        """Deal ``n_steps * dp_size * k`` rows into ``n_steps`` steps of ``dp_size`` replicas of ``k`` rows, then
        move documents between the replicas of each step while that lowers its busiest replica."""
        costs = self._row_costs(rows)
        groups = form_steps(costs, n_steps=n_steps, dp_size=self.dp_size, per_replica=k)
        return self._polished([[[list(rows[i]) for i in b] for b in group] for group in groups])

    def _polished(self, steps: list[list[list[list[tuple[int, int]]]]]) -> list[list[list[list[tuple[int, int]]]]]:
        """Each step polished (``polish_step``), its rows shuffled within each replica."""
        out = []
        for step in steps:
            polish_step(step, self.seq_len)
            out.append([[rows[i] for i in self._rng.permutation(len(rows))] for rows in step])
        return out

    # ------------------------------------------------------------------------------------------------------------
    # emitting

    def _emit(self, step: list[list[list[tuple[int, int]]]], *, build: bool) -> list[dict[str, torch.Tensor]]:
        out, costs = [], []
        for replica_rows in step:
            out.append(self._tensors(replica_rows, build))
            costs.append(float(self._row_costs(replica_rows).sum()))
        mean = sum(costs) / len(costs)
        self.stats.steps += 1
        self.stats.step_imbalance.append(max(costs) / mean if mean > 0 else 1.0)
        return out

    def _tensors(self, rows: list[list[tuple[int, int]]], build: bool = True) -> dict[str, torch.Tensor] | None:
        k, S = len(rows), self.seq_len
        if build:
            input_ids = np.full((k, S), self.pad_token_id, dtype=np.int64)
            labels = np.full((k, S), IGNORE_INDEX, dtype=np.int64)
            doc_ids = np.zeros((k, S), dtype=np.int32)
        for r, row in enumerate(rows):
            pos = 0
            for d, (length, index) in enumerate(row, start=1):
                x, keep = self._take(index, length)
                if build:
                    input_ids[r, pos:pos + length] = x
                    doc_ids[r, pos:pos + length] = d
                    lab = labels[r, pos:pos + length - 1]
                    lab[:] = x[1:]
                    if keep is not None:
                        lab[~keep[1:]] = IGNORE_INDEX
                pos += length
            self.stats.tokens += pos
            self.stats.empty_rows += pos == 0
        self.stats.rows += k
        if not build:
            return None
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
                "doc_ids": torch.from_numpy(doc_ids)}

    def _take(self, index: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The next ``length`` tokens of document ``index`` (pieces are cut in the order they are yielded)."""
        doc = self._held[index]
        a = doc.cursor
        doc.cursor += length
        doc.left -= 1
        self._held_tokens -= length
        if doc.left == 0:
            del self._held[index]
        return doc.ids[a:a + length], None if doc.keep is None else doc.keep[a:a + length]

    def _drop(self, step: list[list[list[tuple[int, int]]]]) -> None:
        pieces = [p for replica_rows in step for row in replica_rows for p in row]
        for length, index in pieces:
            self._take(index, length)
        self.stats.dropped_tokens += sum(p[0] for p in pieces)
        self.stats.dropped_documents += len({p[1] for p in pieces})
        if pieces:
            _log_once("drop-last", "pack_documents: drop_last=True dropped the last, smaller step: %d tokens of %d "
                      "documents (counted in PackingStats.dropped_tokens)",
                      sum(p[0] for p in pieces), len({p[1] for p in pieces}))

    # ------------------------------------------------------------------------------------------------------------
    # state (torchdata's Stateful protocol)

    def _config(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "rows": self.rows, "dp_size": self.dp_size,
                "long_documents": self.long_documents, "buffer_tokens": self.buffer_tokens,
                "buffer_size": self.buffer_size, "seed": self.seed, "pad_token_id": self.pad_token_id,
                "drop_last": self.drop_last, "attention_weight": self.attention_weight,
                "token_weight": self.token_weight}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly where this packer is: a dict of tensors, ints, floats, strings and
        lists (``torch.save`` / ``torch.load(weights_only=True)`` and ``torch.distributed.checkpoint`` take it).

        It holds the tokens of the held documents not yet yielded (at most about ``buffer_tokens``), the
        steps of the current round not yet yielded, the carried pieces, the seeded RNG, the stats and how many
        source documents were read. :meth:`load_state_dict` on a new packer over the same documents continues
        with the steps this one would yield next.
        """
        held = [[d.index, torch.from_numpy(d.ids[d.cursor:].copy()),
                 None if d.keep is None else torch.from_numpy(d.keep[d.cursor:].copy()), d.left]
                for d in self._held.values()]
        return {"version": _STATE_VERSION, "config": self._config(), "documents_read": self.stats.documents,
                "exhausted": self._exhausted, "done": self._done, "held": held,
                "carry": [list(p) for p in self._carry],
                "pending": [[[[list(p) for p in row] for row in rep] for rep in step] for step in self._pending],
                "rng": self._rng.bit_generator.state, "stats": dataclasses.asdict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``: this packer must be new (nothing read yet), with the same
        arguments, over the same documents; the documents read before the state was taken are skipped (read and
        dropped, not converted).

        Raises:
            TypeError: ``state`` not a dict. ValueError: another version, other arguments (named), a packer that
            has started, or documents that run out before the position the state was taken at.
        """
        if not isinstance(state, dict) or "config" not in state:
            raise TypeError(f"state must be a dict from DocumentPacker.state_dict(), got {type(state).__name__}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state has version {state.get('version')!r}; this packer reads version {_STATE_VERSION}")
        diff = {k: (v, state["config"].get(k)) for k, v in self._config().items() if state["config"].get(k) != v}
        if diff:
            shown = ", ".join(f"{k}={theirs!r} (this packer: {mine!r})" for k, (mine, theirs) in diff.items())
            raise ValueError(f"state was saved by a packer with {shown}; build the packer with the arguments of the "
                             "run you resume")
        if self.stats.documents or self._pending or self._done or self._carry:
            raise ValueError("load_state_dict needs a new packer (this one has started); build a new one over the "
                             "same documents and load the state into it before iterating")
        for k in range(state["documents_read"]):
            try:
                next(self._source)
            except StopIteration:
                raise ValueError(f"the documents hold {k} items, fewer than the {state['documents_read']} read when "
                                 "the state was saved; load the state into a packer over the same documents") from None
        self._exhausted, self._done = bool(state["exhausted"]), bool(state["done"])
        self._held = {int(i): _Doc(int(i), ids.numpy(),
                                   None if keep is None else keep.numpy().astype(bool, copy=False), 0, int(left))
                      for i, ids, keep, left in state["held"]}
        self._held_tokens = sum(d.ids.size for d in self._held.values())
        self._carry = [(int(a), int(b)) for a, b in state["carry"]]
        self._pending = deque([[[[(int(a), int(b)) for a, b in row] for row in rep] for rep in step]
                               for step in state["pending"]])
        self._rng.bit_generator.state = state["rng"]
        self.stats = PackingStats(**state["stats"])


def pack_documents(documents: Iterable[Any], **options: Any) -> DocumentPacker:
    """Pack tokenized documents into steps of ``dp_size`` replica batches ``[rows, seq_len]``, balanced across DP.

    ``options`` are :class:`DocumentPacker`'s keyword arguments (listed here; a misspelled one is a TypeError).

    How steps are formed, how documents flow between them and what the cost is: docs/packing.md and
    docs/packing.md. Reads ``documents`` lazily: the documents held at any time have at most ``buffer_tokens``
    tokens not yet yielded, plus the last document read.

    Args:
        documents: an iterable (a list, a generator, a HF ``datasets.Dataset``) of documents, each a sequence of
            non-negative int token ids, a 1-D integer tensor or array, or a dict with ``"input_ids"`` and optional
            ``"labels"`` (HF's unshifted convention: the input ids with ``-100`` where a token is not a target, e.g.
            the prompt; same length). Other keys are ignored.
        seq_len: tokens per row; ``rows * seq_len`` at most ``2**31 - 1`` (int32 ``cu_seqlens``).
        rows: rows per replica per step.
        dp_size: data-parallel replicas; a step is a list of ``dp_size`` dicts.
        long_documents: a document longer than ``seq_len`` is ``"split"`` into pieces of ``seq_len`` (each a new
            document segment in its own row; :attr:`PackingStats.split_documents`), ``"truncate"``\\ d to
            ``seq_len`` (:attr:`PackingStats.truncated_tokens`), or refused (``"error"``: a ValueError).
        buffer_tokens: tokens held at most (best-fit-decreasing and the balancing work over them); at least one step
            (``rows * dp_size * seq_len``). Default :func:`default_buffer_tokens`: eight steps, at least ``2**22``.
        buffer_size: deprecated (a ``FutureWarning``): documents held at most. Alone, it is the only bound, as
            before; with ``buffer_tokens``, both bound the buffer.
        seed: the order of a round's steps and of the rows within a replica (deterministic for a seed).
        pad_token_id: the input id of padding tokens (their label is -100 and doc id 0 whatever it is).
        drop_last: drop the last, smaller step (counted in :attr:`PackingStats.dropped_tokens`, logged once per
            process) instead of yielding it with ``ceil(remaining rows / dp_size)`` rows per replica.
        attention_weight, token_weight: the row cost ``attention_weight * sum L(L+1)/2 + token_weight * seq_len``.
            Every replica gets ``rows * seq_len`` tokens, so the linear part is the same on each and cannot move the
            assignment; with the default 0 :attr:`PackingStats.step_imbalance` is the strict attention-only figure.

    Returns:
        A :class:`DocumentPacker`: iterate it for steps, each a list of ``dp_size`` dicts ``{"input_ids": int64,
        "labels": int64, "doc_ids": int32}`` of shape ``[rows, seq_len]``; its ``.stats`` is a :class:`PackingStats`;
        ``state_dict()`` / ``load_state_dict()`` resume it.

    Raises:
        TypeError: a bad argument type; while iterating, a document (or token) that is not an int sequence.
        ValueError: a non-positive ``seq_len`` / ``rows`` / ``dp_size`` / ``buffer_size``, ``rows * seq_len`` past
            int32, ``buffer_tokens`` below one step, an unknown ``long_documents``; while iterating, an empty, ragged
            or nested document, a negative token, labels of another length or that are neither -100 nor the input
            id, or a document longer than ``seq_len`` under ``"error"``.

    >>> step = next(pack_documents([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, [4, 5]], seq_len=6, rows=1))
    >>> step[0]["input_ids"].tolist(), step[0]["labels"].tolist(), step[0]["doc_ids"].tolist()
    ([[1, 2, 3, 4, 5, 0]], [[2, 3, -100, 5, -100, -100]], [[1, 1, 1, 2, 2, 0]])
    """
    return DocumentPacker(documents, **options)


# ----------------------------------------------------------------------------------------------------------------
# pure pieces: document checks, best-fit-decreasing, assignment to replicas


def _as_tokens(x: Any, what: str) -> np.ndarray:
    """``x`` as a 1-D int64 array, or a TypeError / ValueError naming ``what``."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in INTEGER_DTYPES:
            raise TypeError(f"{what} must hold integer token ids, got a {x.dtype} tensor; convert with .long()")
        arr = x.detach().cpu().numpy()
    elif isinstance(x, (str, bytes)) or not hasattr(x, "__len__"):
        raise TypeError(f"{what} must be a sequence of int token ids, got {type(x).__name__}; tokenize it first"
                        + (" (documents is a list of documents, not one document)" if isinstance(x, int) else ""))
    else:
        try:
            arr = np.asarray(x)
        except ValueError:  # NumPy >= 1.24 on a ragged nested sequence
            raise ValueError(f"{what} is a ragged nested sequence (parts of different lengths, e.g. a list of lists), "
                             "not one document's token ids: pass each document as a flat sequence of ints (flatten "
                             "it, or pass its parts as separate documents)") from None
        if arr.dtype.kind not in "iu" and arr.size:
            flat = x if arr.ndim == 1 else np.ravel(arr)
            bad = next((v for v in flat if not isinstance(v, (int, np.integer)) or isinstance(v, bool)), arr.dtype)
            raise TypeError(f"{what} must hold int token ids, got {bad!r} ({type(bad).__name__}) in it")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D (one document), got shape {tuple(arr.shape)}: a nested sequence; pass "
                         "each document as a flat sequence of token ids (flatten it, or pass its rows as separate "
                         "documents)")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > 2**63 - 1:
        raise ValueError(f"{what} has a token id above int64")
    return arr.astype(np.int64, copy=False)


def _as_document(raw: Any, index: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``(ids int64 [L], keep bool [L] or None)`` of one source document; ``keep`` False where its label is -100."""
    labels = None
    mapping = hasattr(raw, "keys") and hasattr(raw, "__getitem__") and not isinstance(raw, torch.Tensor)
    if isinstance(raw, dict) or mapping:
        if "input_ids" not in raw:
            raise ValueError(f"document {index} is a dict without 'input_ids' (keys: {sorted(raw.keys())})")
        labels = raw.get("labels")
        raw = raw["input_ids"]
    ids = _as_tokens(raw, f"document {index}")
    if ids.size == 0:
        raise ValueError(f"document {index} is empty; filter empty documents out before packing")
    if int(ids.min()) < 0:
        raise ValueError(f"document {index} has a negative token id {int(ids.min())}; token ids are >= 0")
    if labels is None:
        return ids, None
    lab = _as_tokens(labels, f"labels of document {index}")
    if lab.size != ids.size:
        raise ValueError(f"labels of document {index} have {lab.size} tokens but input_ids {ids.size}; labels must "
                         "be the unshifted input ids with -100 where a token is not a target")
    keep = lab != IGNORE_INDEX
    bad = np.flatnonzero(keep & (lab != ids))
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"labels of document {index} at position {t} is {int(lab[t])}, neither -100 nor the input id "
                         f"{int(ids[t])}: pass HF-style unshifted labels (the packer shifts them)")
    return ids, None if keep.all() else keep


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of ``capacity``: each length, longest first, into the open bin with the least room that fits it.

    Ties keep the input order (a stable sort; the lowest bin on equal room). Every length must be ``<= capacity``.

    Returns:
        One list of indices into ``lengths`` per bin, in the order they were placed.

    >>> best_fit_decreasing([3, 5, 2, 4], 7)
    [[1, 2], [3, 0]]
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    bins: list[list[int]] = []
    used: list[int] = []
    room: list[int] = []  # sorted keys room * _KEY + bin of the open bins
    for i in order:
        length = lengths[i]
        j = bisect.bisect_left(room, length * _KEY)
        if j < len(room):
            b = room.pop(j) % _KEY
        else:
            b = len(bins)
            bins.append([])
            used.append(0)
        bins[b].append(i)
        used[b] += length
        if used[b] < capacity:
            bisect.insort(room, (capacity - used[b]) * _KEY + b)
    return bins


def form_steps(costs: np.ndarray, *, n_steps: int, dp_size: int, per_replica: int) -> list[list[list[int]]]:
    """Group rows into ``n_steps`` steps of ``dp_size`` replicas of ``per_replica`` rows, so that the replicas of a
    step cost about the same.

    Steps are formed heaviest first: the ``dp_size`` costliest rows left anchor the replicas; then, slot by slot, the
    costliest replica takes the cheapest row left and every other replica (neediest first) the row whose cost is
    closest to its share of the gap to the costliest one. Returns row indices per replica per step.

    >>> form_steps(np.array([9., 1., 5., 4., 2., 2.]), n_steps=1, dp_size=2, per_replica=3)
    [[[0, 1, 4], [2, 5, 3]]]
    """
    if costs.size != n_steps * dp_size * per_replica:
        raise ValueError(f"form_steps needs n_steps * dp_size * per_replica = {n_steps * dp_size * per_replica} "
                         f"rows, got {costs.size}")
    order = np.argsort(costs, kind="stable")
    pool_cost = costs[order].tolist()  # ascending
    pool_row = order.tolist()
    steps = []
    for _ in range(n_steps):
        bins = [[pool_row.pop()] for _ in range(dp_size)]
        totals = [pool_cost.pop() for _ in range(dp_size)]
        for slot in range(1, per_replica):
            top = max(range(dp_size), key=totals.__getitem__)
            bins[top].append(pool_row.pop(0))
            totals[top] += pool_cost.pop(0)
            left = per_replica - slot
            for b in sorted((b for b in range(dp_size) if b != top), key=totals.__getitem__):
                want = (totals[top] - totals[b]) / left
                j = bisect.bisect_left(pool_cost, want)
                if j == len(pool_cost) or (j > 0 and want - pool_cost[j - 1] <= pool_cost[j] - want):
                    j -= 1
                bins[b].append(pool_row.pop(j))
                totals[b] += pool_cost.pop(j)
        steps.append(bins)
    return steps


_GROUP = 16  # polish_step also exchanges the m smallest pieces of a row together, m = 2 .. _GROUP
_STRATA_MINE = 64  # length strata of the busiest replica's candidates kept per exchange (3 candidates each)
_STRATA_THEIRS = 512  # length strata of the other replicas' candidates kept per exchange, over all of them


def _f(x):
    """``x (x + 1) / 2``: the causal cost of a segment of ``x`` tokens (ints or int64 arrays)."""
    return x * (x + 1) // 2


@dataclass
class _Candidates:
    """What every row of a step can give away in one exchange, flat over the step's ``R`` rows (``polish_step``):
    one piece (``kind`` 0, ``ref`` the piece), its ``m`` shortest pieces together (``kind`` m >= 2, ``ref`` the
    row) or nothing (``kind`` -1, a move rather than a swap)."""

    row: np.ndarray  # int64 [C]
    kind: np.ndarray  # int64 [C]
    ref: np.ndarray  # int64 [C]
    length: np.ndarray  # int64 [C] tokens given
    cost: np.ndarray  # float64 [C] attention cost given
    order: np.ndarray  # int64 [P] pieces by (row, length, index)
    row_start: np.ndarray  # int64 [R] where a row's pieces start in ``order``
    pad: np.ndarray  # int64 [R] room left in each row
    row_cost: np.ndarray  # float64 [R] sum f(L) + f(pad)


def _row_candidates(L: np.ndarray, row_of: np.ndarray, n_rows: int, seq_len: int) -> _Candidates:
    """Every candidate of every row: O(P log P) (one sort), no Python loop over pieces."""
    P = L.size
    order = np.lexsort((np.arange(P), L, row_of))
    r, length = row_of[order], L[order]
    cost = _f(length).astype(np.float64)
    counts = np.bincount(row_of, minlength=n_rows)
    row_start = np.cumsum(counts) - counts
    rank = np.arange(P) - row_start[r]  # 0 for a row's shortest piece
    cum_l, cum_c = np.cumsum(length), np.cumsum(cost)
    first = row_start[r]
    prefix_l, prefix_c = cum_l - (cum_l - length)[first], cum_c - (cum_c - cost)[first]
    pad = seq_len - np.bincount(row_of, weights=L, minlength=n_rows).astype(np.int64)
    row_cost = np.bincount(row_of, weights=_f(L).astype(np.float64), minlength=n_rows) + _f(pad).astype(np.float64)
    group = (rank >= 1) & (rank < _GROUP)
    every = np.arange(n_rows)
    none = np.zeros(n_rows, dtype=np.int64)
    return _Candidates(
        row=np.concatenate([r, r[group], every]),
        kind=np.concatenate([np.zeros(P, np.int64), rank[group] + 1, none - 1]),
        ref=np.concatenate([order, r[group], every]), length=np.concatenate([length, prefix_l[group], none]),
        cost=np.concatenate([cost, prefix_c[group], none.astype(np.float64)]), order=order, row_start=row_start,
        pad=pad, row_cost=row_cost)


def _thinned(idx: np.ndarray, cand: _Candidates, strata: int) -> np.ndarray:
    """``idx`` (candidates of one replica) thinned to at most 3 per length stratum: the cheapest, the costliest and
    the one in the row with the most room; a row's "nothing" candidate is always kept."""
    nothing = idx[cand.kind[idx] < 0]
    idx = idx[cand.kind[idx] >= 0]
    n = idx.size
    if n <= 3 * strata:
        return np.concatenate([idx, nothing])
    o = idx[np.argsort(cand.length[idx], kind="stable")]
    stratum = np.arange(n) * strata // n  # sorted
    keep = [nothing]
    for key in (cand.cost[o], cand.pad[cand.row[o]]):
        s = np.lexsort((key, stratum))
        edge = np.flatnonzero(np.diff(stratum[s])) + 1
        keep += [o[s[np.r_[0, edge]]], o[s[np.r_[edge - 1, n - 1]]]]
    return np.unique(np.concatenate(keep[:3] + keep[4:]))  # cheapest, costliest, roomiest


def _best_exchange(cand: _Candidates, totals: np.ndarray, row_rep: np.ndarray, busiest: int):
    """``(i, j)``: the exchange of candidate ``i`` of the busiest replica and ``j`` of another that lowers the
    larger of the two replicas' new costs the most, among a bounded choice (``_thinned``); ``None`` when none lowers
    the busiest. Memory O(_STRATA_MINE * _STRATA_THEIRS), whatever the number of pieces."""
    dp = totals.size
    rep = row_rep[cand.row]
    by_rep = np.argsort(rep, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(rep, minlength=dp))]
    k_theirs = max(4, _STRATA_THEIRS // (dp - 1))
    mine = _thinned(by_rep[bounds[busiest]:bounds[busiest + 1]], cand, _STRATA_MINE)
    theirs = np.concatenate([_thinned(by_rep[bounds[r]:bounds[r + 1]], cand, k_theirs)
                             for r in range(dp) if r != busiest])
    la, ca, pa = cand.length[mine, None], cand.cost[mine, None], cand.pad[cand.row[mine], None]
    lb, cb, pb = cand.length[None, theirs], cand.cost[None, theirs], cand.pad[cand.row[theirs]][None, :]
    diff = la - lb  # [na, nb] tokens the busiest row gives away
    fits = (pa + diff >= 0) & (pb - diff >= 0) & ((la > 0) | (lb > 0))
    work = cb - ca  # [na, nb] piece cost the busiest replica gains
    new_a = totals[busiest] + (work + (_f(pa + diff) - _f(pa)).astype(np.float64))
    new_b = totals[rep[theirs]][None, :] + ((_f(pb - diff) - _f(pb)).astype(np.float64) - work)
    worst = np.where(fits, np.maximum(new_a, new_b), np.inf)
    i, j = np.unravel_index(np.argmin(worst), worst.shape)
    if not worst[i, j] < totals[busiest] * (1 - 1e-9):
        return None
    return int(mine[i]), int(theirs[j])


def _given(cand: _Candidates, c: int) -> np.ndarray:
    """The pieces candidate ``c`` gives away."""
    kind = int(cand.kind[c])
    if kind < 0:
        return cand.order[:0]
    if kind == 0:
        return cand.ref[c:c + 1]
    start = int(cand.row_start[cand.ref[c]])
    return cand.order[start:start + kind]


def polish_step(step: list[list[list[tuple[int, int]]]], seq_len: int, max_moves: int = 256, tol: float = 2e-3) -> None:
    """In place: exchange pieces between a row of the busiest replica and a row of another replica while that lowers
    the busiest replica's cost; every row keeps ``<= seq_len`` tokens, so the step's fill is unchanged.

    ``step[replica][row]`` is a list of ``(length, source)`` pieces. What is exchanged on each side: one piece, the
    ``m`` smallest pieces of the row together (one long document against several short ones moves the most work),
    or nothing (a move). The cost of a row is ``sum f(L)`` over its pieces plus ``f(padding)``, ``f(L) = L(L+1)/2``,
    so a piece moved into a padded row also shortens its padding run. Stops at a local optimum, after ``max_moves``
    exchanges, or once the busiest replica is within ``tol`` of the mean.

    Bounded: each exchange is chosen among at most ``3 * _STRATA_MINE`` candidates of the busiest replica and
    ``3 * _STRATA_THEIRS`` of the others (the cheapest, costliest and roomiest of each length stratum, plus every
    row's "nothing"), never a pieces x pieces matrix: time O(max_moves * P log P), memory O(P) for ``P`` pieces.
    """
    dp = len(step)
    if dp < 2:
        return
    row_rep = np.repeat(np.arange(dp), [len(rows) for rows in step])
    flat = [(p, g) for g, row in enumerate(row for rows in step for row in rows) for p in row]
    L = np.array([p[0][0] for p in flat], dtype=np.int64)
    row_of = np.array([p[1] for p in flat], dtype=np.int64)
    n_rows, moved = row_rep.size, False
    for _ in range(max_moves):
        cand = _row_candidates(L, row_of, n_rows, seq_len)
        totals = np.bincount(row_rep, weights=cand.row_cost, minlength=dp)
        busiest = int(np.argmax(totals))
        if totals[busiest] <= (1 + tol) * totals.mean():
            break
        best = _best_exchange(cand, totals, row_rep, busiest)
        if best is None:
            break
        x, y = _given(cand, best[0]), _given(cand, best[1])
        row_a, row_b = cand.row[best[0]], cand.row[best[1]]
        row_of[x], row_of[y] = row_b, row_a
        moved = True
    if moved:  # write the rows back, every row's pieces in their original order
        rows: list[list[tuple[int, int]]] = [[] for _ in range(n_rows)]
        for (piece, _), g in zip(flat, row_of.tolist()):
            rows[g].append(piece)
        it = iter(rows)
        for replica in step:
            replica[:] = [next(it) for _ in replica]


def step_costs(step: list[list[list[tuple[int, int]]]], seq_len: int) -> list[int]:
    """Attention cost of every replica of a step: ``sum L(L+1)/2`` over its pieces and every row's padding run."""
    out = []
    for rows in step:
        total = 0
        for pieces in rows:
            pad = seq_len - sum(p[0] for p in pieces)
            total += sum(p[0] * (p[0] + 1) // 2 for p in pieces) + pad * (pad + 1) // 2
        out.append(total)
    return out


def _heavy_targets(costs: list[int], n_steps: int, dp_size: int) -> tuple[int, list[float]]:
    """How many steps the costliest pieces anchor, and every bin's target cost.

    A piece that costs more than a bin's fair share ``T`` cannot be balanced against the mean, so its step must hold
    ``dp_size`` such pieces: the ``h`` costliest pieces anchor the first ``ceil(h / dp_size)`` steps, ``dp_size``
    consecutive ones per step; every bin of such a step targets its step's costliest anchor, the other bins share
    the rest (``T``, recomputed until no more pieces exceed it). ``costs`` is sorted in decreasing order.
    """
    total, n_bins = sum(costs), n_steps * dp_size
    heavy_steps = 0
    while heavy_steps < n_steps:
        anchored = heavy_steps * dp_size
        reserved = sum(costs[j * dp_size] * dp_size for j in range(heavy_steps))
        share = (total - reserved) / max(n_bins - anchored, 1)
        if anchored >= len(costs) or costs[anchored] <= share:
            break
        heavy_steps += 1
    targets = [float(costs[(b // dp_size) * dp_size]) if b < heavy_steps * dp_size else share for b in range(n_bins)]
    return heavy_steps, targets


def balanced_pack(pieces: list[tuple[int, int]], *, n_steps: int, dp_size: int, per_replica: int, seq_len: int,
                  tail_share: float = 0.02) -> tuple[list[list[list[list[tuple[int, int]]]]], list[tuple[int, int]]]:
    """Pack pieces into ``n_steps`` steps of ``dp_size`` replicas of ``per_replica`` rows, the replicas of a step
    costing about the same (cost ``sum L(L+1)/2``).

    The costliest pieces anchor steps ``dp_size`` at a time (see ``_heavy_targets``); then, longest first, each
    piece goes to the replica furthest below its target that has a row where it fits (the row with the least room
    that fits). Once the pieces left hold less than ``tail_share`` of the total cost, each goes to the row with the
    least room that fits it anywhere (best fit: short pieces close the gaps). The non-anchored replicas are grouped
    into steps by cost. Returns the steps and the pieces that fit nowhere.

    >>> steps, left = balanced_pack([(4, 0), (4, 1), (2, 2), (2, 3), (3, 4)], n_steps=1, dp_size=2, per_replica=1,
    ...                             seq_len=6)
    >>> steps, left
    ([[[[(4, 0), (2, 2)]], [[(4, 1), (2, 3)]]]], [(3, 4)])
    """
    order = sorted(pieces, key=lambda p: -p[0])
    n_bins = n_steps * dp_size
    costs = [_f(p[0]) for p in order]
    heavy_steps, target = _heavy_targets(costs, n_steps, dp_size)
    bins: list[list[list[tuple[int, int]]]] = [[[] for _ in range(per_replica)] for _ in range(n_bins)]
    room = [[seq_len] * per_replica for _ in range(n_bins)]
    cost = [0.0] * n_bins
    left: list[tuple[int, int]] = []

    def put(piece, b, q):
        bins[b][q].append(piece)
        room[b][q] -= piece[0]
        cost[b] += _f(piece[0])

    n_anchors = min(heavy_steps * dp_size, len(order))
    for j in range(n_anchors):
        put(order[j], j, 0)
    cost_left = sum(costs[n_anchors:])
    tail = tail_share * sum(costs)
    heap = [(cost[b] - target[b], b) for b in range(n_bins)]  # most below target first
    heapq.heapify(heap)
    n = n_anchors
    while n < len(order) and cost_left >= tail:
        piece = order[n]
        skipped, placed = [], False
        while heap:
            key, b = heapq.heappop(heap)
            rb = room[b]
            q = min((q for q in range(per_replica) if rb[q] >= piece[0]), key=rb.__getitem__, default=None)
            if q is None:
                if max(rb) > 0:
                    skipped.append((key, b))
                continue
            put(piece, b, q)
            heapq.heappush(heap, (cost[b] - target[b], b))
            placed = True
            break
        for item in skipped:
            heapq.heappush(heap, item)
        if not placed:
            left.append(piece)
        cost_left -= costs[n]
        n += 1
    # the tail: best fit over every row
    keys = sorted(room[b][q] * _KEY + b * per_replica + q
                  for b in range(n_bins) for q in range(per_replica) if room[b][q] > 0)
    for piece in order[n:]:
        j = bisect.bisect_left(keys, piece[0] * _KEY)
        if j == len(keys):
            left.append(piece)
            continue
        b, q = divmod(keys.pop(j) % _KEY, per_replica)
        put(piece, b, q)
        if room[b][q] > 0:
            bisect.insort(keys, room[b][q] * _KEY + b * per_replica + q)
    anchored = heavy_steps * dp_size
    rest = sorted(range(anchored, n_bins), key=lambda b: -cost[b])
    groups = [list(range(s * dp_size, (s + 1) * dp_size)) for s in range(heavy_steps)]
    groups += [rest[i:i + dp_size] for i in range(0, len(rest), dp_size)]
    return [[bins[b] for b in g] for g in groups], left
