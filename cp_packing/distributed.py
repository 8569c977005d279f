"""Ship packed batches and their context-parallel metadata over ``torch.distributed``.

A batch reaches a CP group in one of two ways, and each has one entry point per payload:

* **every rank loaded the same batch** (``src=None``): each rank shards it locally with
  ``shard_packed_seq_params``; no communication at all. ``check_consistent=True`` adds ONE small all-gather of a
  fingerprint (shape, segment count, layout and a few int64 checksums) and raises on every rank when the ranks do
  not hold the same batch (a data loader seeded per rank instead of per CP group is a classic silent bug).
* **one source rank loaded it** (``src=<group rank>``): the source ships each rank only what that rank needs:

  1. a fixed-size int64 header (``HEADER_LEN`` words: ``B``, ``S``, segment count, ``max_seqlen``, doc-map dtype,
     the resolved layout, payload sizes, or an error code);
  2. ONE broadcast of the run-length-encoded doc map: ``cu_seqlens`` (int64 ``[num_segments + 1]``) and the doc
     index of every segment (``[num_segments]``), plus (``distribute_batch``) a short JSON of key names, dtypes and
     trailing shapes. The doc map is a pure function of ``(B, S, cu_seqlens, segment doc index)``, so every rank
     rebuilds the global ``PackedSeqParams`` bit for bit (``repeat_interleave``) and shards it locally;
  3. (``distribute_batch`` only) one ``dist.scatter`` per key: row r of ``x[token order]`` (``[cp, T_local * F]``,
     rows contiguous, so no packing copy) goes to rank r, as raw bytes (a free ``view(torch.uint8)``, so every dtype
     travels, bool included). A rank receives its ``T_local`` tokens, never the whole batch.

  Two broadcasts plus one scatter per key. The result equals local sharding exactly.

Groups. ``group`` is a ``ProcessGroup``, a 1-D ``DeviceMesh`` (the CP dimension of a DP x CP mesh: ``mesh["cp"]``) or
``None`` for the default (world) group. The CP rank and size are the rank and size *in that group*, never the global
ones; ``src`` is a *group* rank (0 .. cp_size-1), converted to the global rank the collectives need.

Device. NCCL moves CUDA tensors only, gloo CPU ones: the communication device follows ``dist.get_backend(group)``
(a backend naming ``nccl``, e.g. ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``: ``torch.device("cuda",
torch.cuda.current_device())``, so set the current device first, as torchrun scripts do; anything else: CPU). In the
``src`` path every output tensor lives on that device, on every rank (the source's inputs may live anywhere); in the
local path the outputs stay on the inputs' device.

Errors on every rank. A rank that raises while the others enter a collective leaves them waiting forever (NCCL hangs
until its watchdog fires). So: argument errors that every rank can see (``src`` outside the group, a bad layout
name, a 2-D mesh, a wrong type) are raised by every rank before any communication; errors only the source can see
(a bad batch, an indivisible map, a bad ``params``) are caught on the source, shipped in the header, and raised on
every rank with the same type and message; with ``check_consistent`` a rank whose own input fails joins the
all-gather with an error flag, so every rank raises. An all-padding rank joins every collective like any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from cp_packing.groups import CPGroup, resolve_group
from cp_packing.layouts import LAYOUTS
from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids
from cp_packing.sharding import ShardedPackedSeqParams, shard_packed_seq_params

__all__ = [
    "DOC_IDS_KEY",
    "HEADER_LEN",
    "distribute_packed_seq_params",
    "distribute_batch",
]

DOC_IDS_KEY = "doc_ids"
"""The batch key ``distribute_batch`` builds ``PackedSeqParams`` from when ``params`` is not given."""

# Header words (int64), broadcast from the source first. Every rank knows every payload size from it.
_H_TAG, _H_STATUS, _H_B, _H_S, _H_NSEG, _H_MAXLEN, _H_DTYPE, _H_LAYOUT, _H_JSON_BYTES, _H_TOKEN_BYTES = range(10)
HEADER_LEN = 10

_TAG_PARAMS = 0x43500001  # distribute_packed_seq_params
_TAG_BATCH = 0x43500002  # distribute_batch
_CALL_NAMES = {_TAG_PARAMS: "distribute_packed_seq_params", _TAG_BATCH: "distribute_batch"}

# Status codes: the exception class every rank raises.
_STATUS_OK = 0
_ERROR_CLASSES = (ValueError, TypeError, RuntimeError)  # status 1, 2, 3

_LAYOUT_CODES = {name: i for i, name in enumerate(LAYOUTS)}
_LAYOUT_AUTO = len(LAYOUTS)  # only in the argument fingerprint of check_consistent

_DOC_DTYPES = tuple(
    getattr(torch, name)
    for name in ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")
    if hasattr(torch, name)
)

_M64 = (1 << 64) - 1


# --------------------------------------------------------------------------------------------------------------
# Groups and devices


def _check_src(src: Any, cp: CPGroup) -> int | None:
    if src is None:
        return None
    if not isinstance(src, int) or isinstance(src, bool):
        raise TypeError(f"src must be an int (a rank of the CP group) or None, got {src!r} ({type(src).__name__})")
    if not 0 <= src < cp.size:
        raise ValueError(
            f"src={src} is outside the CP group: src is a GROUP rank in [0, {cp.size}) (the group has {cp.size} "
            "ranks), not a global rank; convert a global rank with torch.distributed.get_group_rank(group, rank)"
        )
    return src


def _check_layout_arg(layout: Any) -> None:
    if layout != "auto" and layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)} or 'auto'")


def _check_flag(check_consistent: Any) -> None:
    if not isinstance(check_consistent, bool):
        raise TypeError(f"check_consistent must be a bool, got {check_consistent!r}")


# --------------------------------------------------------------------------------------------------------------
# Encoding helpers (pure)


def _json_to_words(obj: Any) -> tuple[torch.Tensor, int]:
    """JSON -> (int64 words ``[ceil(n / 8)]``, byte count n)."""
    raw = json.dumps(obj, separators=(",", ":")).encode()
    n = len(raw)
    padded = bytearray(raw + b"\0" * (-n % 8))
    return torch.frombuffer(padded, dtype=torch.uint8).view(torch.int64).clone(), n


def _words_to_json(words: torch.Tensor, n: int) -> Any:
    raw = words.cpu().contiguous().view(torch.uint8)[:n].numpy().tobytes()
    return json.loads(raw.decode())


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown dtype {name!r} in the batch header")
    return dtype


def _num_features(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _segment_doc_index(params: PackedSeqParams) -> torch.Tensor:
    """int64 ``[num_segments]``: the doc index of every segment (the value at its first token)."""
    starts = params.cu_seqlens[:-1].to(device=params.doc_ids.device, dtype=torch.int64)
    return params.doc_ids.reshape(-1).index_select(0, starts).to(torch.int64)


def _params_to(params: PackedSeqParams, device: torch.device) -> PackedSeqParams:
    if params.cu_seqlens.device == device and params.doc_ids.device == device:
        return params
    return PackedSeqParams(params.cu_seqlens.to(device), params.max_seqlen, params.doc_ids.to(device))


def _doc_dtype_code(params: PackedSeqParams) -> int:
    try:
        return _DOC_DTYPES.index(params.doc_ids.dtype)
    except ValueError:
        raise TypeError(f"doc_ids dtype {params.doc_ids.dtype} cannot be shipped; convert with .to(torch.int32)")


@dataclass(frozen=True)
class _SrcMessage:
    """What the source sends: ``header`` int64 ``[HEADER_LEN]`` (broadcast), ``payload`` int64 ``[P]`` (broadcast,
    skipped when ``P == 0``), ``tokens``: per batch key, uint8 ``[cp_size, T_local * F * itemsize]`` (row r scattered
    to rank r), or None."""

    header: torch.Tensor
    payload: torch.Tensor
    tokens: list[torch.Tensor] | None


def _prepare_batch(batch: Any, params: Any) -> tuple[PackedSeqParams, dict[str, torch.Tensor]]:
    """Validate a batch dict (and build params from ``batch[DOC_IDS_KEY]`` when None). Local, no communication."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch must be a dict of per-token tensors [B, S, ...] (input_ids, labels, ...), got "
            f"{type(batch).__name__}"
        )
    for key, value in batch.items():
        if not isinstance(key, str):
            raise TypeError(f"batch keys must be str, got {key!r} ({type(key).__name__})")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"batch[{key!r}] must be a torch.Tensor [B, S, ...], got {type(value).__name__}")
    if params is None:
        if DOC_IDS_KEY not in batch:
            raise ValueError(
                f"distribute_batch needs the doc map: pass params=packed_seq_params_from_doc_ids(doc_ids) or put the "
                f"[B, S] doc map in batch[{DOC_IDS_KEY!r}] (keys given: {sorted(batch)})"
            )
        params = packed_seq_params_from_doc_ids(batch[DOC_IDS_KEY])
    elif not isinstance(params, PackedSeqParams):
        raise TypeError(
            f"params must be PackedSeqParams or None, got {type(params).__name__}; build it with "
            "packed_seq_params_from_doc_ids(doc_ids)"
        )
    B, S = params.doc_ids.shape
    for key, value in batch.items():
        if value.dim() < 2 or tuple(value.shape[:2]) != (B, S):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}; every per-token tensor must be [B, S, ...] = "
                f"[{B}, {S}, ...] like the doc map (unflatten a flat tensor with x.view({B}, {S}, ...), drop or "
                "broadcast per-row tensors before calling)"
            )
    return params, dict(batch)


def _encode_src(
    tag: int, params: PackedSeqParams, sharded: ShardedPackedSeqParams, batch: dict | None, device: torch.device
) -> _SrcMessage:
    """The source's message for a valid batch (``params`` and ``sharded`` already on ``device``)."""
    B, S = params.doc_ids.shape
    nseg = params.num_segments
    parts = [params.cu_seqlens.to(torch.int64), _segment_doc_index(params).to(device)]
    json_bytes = token_bytes = 0
    tokens = None
    if batch is not None:
        specs = [[k, str(v.dtype).removeprefix("torch."), list(v.shape[2:])] for k, v in batch.items()]
        words, json_bytes = _json_to_words({"keys": specs})
        parts.append(words.to(device))
        cp_size = sharded.cp_size
        T_local = B * S // cp_size
        order = sharded.global_token_order().reshape(-1)  # int64 [cp * T_local]: rank 0's tokens, rank 1's, ...
        tokens = []
        for x in batch.values():
            n_features = _num_features(tuple(x.shape[2:]))
            flat = x.reshape(B * S) if n_features == 1 else x.reshape(B * S, n_features)  # [T] or [T, F]
            picked = flat.index_select(0, order.to(x.device))  # 1-D index_select is the fast kernel
            per_rank = picked.reshape(cp_size, T_local * n_features)  # [cp, T_local * F], rows contiguous
            tokens.append(per_rank.view(torch.uint8).to(device))  # [cp, T_local * F * itemsize]: a view, no copy
        token_bytes = sum(t.shape[1] for t in tokens)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[_H_TAG] = tag
    header[_H_B], header[_H_S], header[_H_NSEG] = B, S, nseg
    header[_H_MAXLEN] = params.max_seqlen
    header[_H_DTYPE] = _doc_dtype_code(params)
    header[_H_LAYOUT] = _LAYOUT_CODES[sharded.layout]
    header[_H_JSON_BYTES], header[_H_TOKEN_BYTES] = json_bytes, token_bytes
    return _SrcMessage(header.to(device), torch.cat(parts), tokens)


def _encode_error(tag: int, status: int, message: str, device: torch.device) -> _SrcMessage:
    words, n = _json_to_words({"message": message})
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[_H_TAG], header[_H_STATUS], header[_H_JSON_BYTES] = tag, status, n
    return _SrcMessage(header.to(device), words.to(device), None)


def _status_of(exc: BaseException) -> int:
    for i, cls in enumerate(_ERROR_CLASSES):
        if isinstance(exc, cls):
            return i + 1
    return len(_ERROR_CLASSES)  # anything else -> RuntimeError


def _payload_len(header: list[int]) -> int:
    json_words = (header[_H_JSON_BYTES] + 7) // 8
    if header[_H_STATUS] != _STATUS_OK:
        return json_words
    return 2 * header[_H_NSEG] + 1 + json_words


def src_message_bytes(
    params: PackedSeqParams, batch: Mapping[str, torch.Tensor] | None, *, cp_size: int, layout: str = "zigzag"
) -> dict[str, int]:
    """Bytes a NON-source rank receives in each collective of the ``src`` path (pure; for benchmarks and docs).

    Counted from the very tensors the source sends: ``header`` (``HEADER_LEN`` int64), ``metadata`` (the
    run-length-encoded doc map + batch header: ``(2 * num_segments + 1)`` int64 plus the JSON words) and ``tokens``
    (``distribute_batch`` only: ``T_local * sum(itemsize * features)`` of this rank's row of the scatter).
    """
    if batch is not None:
        params, batch = _prepare_batch(batch, params)
    sharded = shard_packed_seq_params(params, cp_size=cp_size, cp_rank=0, layout=layout)
    msg = _encode_src(_TAG_BATCH if batch is not None else _TAG_PARAMS, params, sharded, batch,
                      params.cu_seqlens.device)
    sizes = {
        "header": msg.header.numel() * msg.header.element_size(),
        "metadata": msg.payload.numel() * msg.payload.element_size(),
        "tokens": 0 if msg.tokens is None else sum(t.shape[1] for t in msg.tokens),
    }
    sizes["total"] = sum(sizes.values())
    return sizes


# --------------------------------------------------------------------------------------------------------------
# The two paths


def _raise_shipped(status: int, message: str) -> None:
    raise _ERROR_CLASSES[min(max(status, 1), len(_ERROR_CLASSES)) - 1](message)


def _from_src(
    cp: CPGroup, src: int, layout: str, tag: int, prepare: Callable[[], tuple[PackedSeqParams, dict | None]]
) -> tuple[ShardedPackedSeqParams, dict[str, torch.Tensor] | None]:
    """The source prepares, validates and ships; every rank rebuilds the global params and shards them."""
    gsrc = cp.global_rank(src)
    where = f"(raised on the source, group rank {src} = global rank {gsrc}; every rank of the CP group raises it)"
    device = cp.device

    def send_or_recv(t: torch.Tensor) -> None:
        if t.numel():
            dist.broadcast(t, src=gsrc, group=cp.group)

    if cp.rank == src:
        try:
            params, batch = prepare()
            params = _params_to(params, device)
            sharded = shard_packed_seq_params(params, cp_size=cp.size, cp_rank=cp.rank, layout=layout)
            msg = _encode_src(tag, params, sharded, batch, device)
        except Exception as exc:  # noqa: BLE001 - shipped to every rank, then re-raised here
            status = _status_of(exc)
            message = f"{exc} {where}" if status < len(_ERROR_CLASSES) else f"{type(exc).__name__}: {exc} {where}"
            err = _encode_error(tag, status, message, device)
            send_or_recv(err.header)
            send_or_recv(err.payload)
            raise _ERROR_CLASSES[status - 1](message) from exc
        send_or_recv(msg.header)
        send_or_recv(msg.payload)
        header = msg.header.tolist()
        payload = msg.payload
        tokens = msg.tokens
    else:
        header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        send_or_recv(header_t)
        header = header_t.tolist()
        payload = torch.empty(_payload_len(header), dtype=torch.int64, device=device)
        send_or_recv(payload)
        if header[_H_STATUS] != _STATUS_OK:
            _raise_shipped(header[_H_STATUS], _words_to_json(payload, header[_H_JSON_BYTES])["message"])
        tokens = None

    # The SOURCE's call decides which collectives follow: a rank that made another call still joins them (and
    # discards what it receives) before it raises, so the source is never left waiting in a scatter.
    mismatch = header[_H_TAG] != tag
    B, S, nseg = header[_H_B], header[_H_S], header[_H_NSEG]
    T_local = B * S // cp.size
    local_batch = None
    if header[_H_TAG] == _TAG_BATCH:
        specs = _words_to_json(payload[2 * nseg + 1 :], header[_H_JSON_BYTES])["keys"]
        local_batch = {}
        for i, (name, dtype_name, trailing) in enumerate(specs):
            dtype = _dtype_from_name(dtype_name)
            n = T_local * _num_features(tuple(trailing)) * torch.empty((), dtype=dtype).element_size()
            received = torch.empty(n, dtype=torch.uint8, device=device)  # this rank's bytes of this key
            if n:  # every rank knows n from the header: all skip together
                scatter_list = list(tokens[i].unbind(0)) if cp.rank == src else None
                dist.scatter(received, scatter_list, src=gsrc, group=cp.group)
            local_batch[name] = received.view(dtype).reshape(1, T_local, *trailing)  # [1, T_local, ...]

    # Every collective is done: from here on a rank may fail alone without leaving others waiting.
    if mismatch:
        raise ValueError(
            f"the source (group rank {src}) called {_CALL_NAMES.get(header[_H_TAG], '?')} while this rank "
            f"called {_CALL_NAMES[tag]}; every rank of the CP group must make the same call"
        )
    if cp.rank == src:
        return sharded, local_batch
    cu = payload[: nseg + 1]  # int64 [num_segments + 1]
    seg_doc = payload[nseg + 1 : 2 * nseg + 1]  # int64 [num_segments]
    doc_ids = torch.repeat_interleave(seg_doc, cu[1:] - cu[:-1], output_size=B * S)  # [B*S]
    params = PackedSeqParams(
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=header[_H_MAXLEN],
        doc_ids=doc_ids.to(_DOC_DTYPES[header[_H_DTYPE]]).reshape(B, S),
    )
    sharded = shard_packed_seq_params(params, cp_size=cp.size, cp_rank=cp.rank, layout=LAYOUTS[header[_H_LAYOUT]])
    return sharded, local_batch


_FINGERPRINT_FIELDS = (
    "call", "B", "S", "num_segments", "max_seqlen", "doc_ids dtype", "layout",
    "cu_seqlens / doc_ids checksum", "batch keys / dtypes / shapes", "batch tensor checksum",
)


def _mix(values: list[int]) -> int:
    """FNV-1a style 64-bit fold of a list of ints (signed int64 result)."""
    h = 0xCBF29CE484222325
    for v in values:
        h = ((h ^ (v & _M64)) * 0x100000001B3) & _M64
    return h - (1 << 64) if h >= 1 << 63 else h


def _int64_sums(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]``: plain and position-weighted sums of a tensor's bits (wrapping). A cheap fingerprint, not a
    cryptographic hash: any realistic difference (a shifted document, another sample) changes it."""
    flat = x.detach().reshape(-1)
    if flat.dtype == torch.bool:
        ints = flat.to(torch.int64)
    elif flat.is_floating_point() or flat.is_complex():
        size = flat.element_size()
        view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(size, torch.int64)
        ints = flat.contiguous().view(view_dtype).to(torch.int64)
    else:
        ints = flat.to(torch.int64)
    weights = torch.arange(ints.numel(), dtype=torch.int64, device=ints.device) * 0x5851F42D + 0x14057B7E
    return torch.stack([ints.sum(), (ints * weights).sum()]).cpu()


def _fingerprint(tag: int, params: PackedSeqParams, sharded: ShardedPackedSeqParams, batch: dict | None) -> list[int]:
    B, S = params.doc_ids.shape
    meta = [_int64_sums(params.cu_seqlens), _int64_sums(_segment_doc_index(params))]
    keys_hash = data_hash = 0
    if batch is not None:
        items = sorted(batch.items(), key=lambda kv: kv[0])  # the result does not depend on the dict's key order, nor does the check
        keys_hash = _mix(list(json.dumps([[k, str(v.dtype), list(v.shape)] for k, v in items]).encode()))
        if batch:
            data_hash = _mix(torch.cat([_int64_sums(v) for _, v in items]).tolist())
    return [tag, B, S, params.num_segments, params.max_seqlen, _doc_dtype_code(params),
            _LAYOUT_CODES[sharded.layout], _mix(torch.cat(meta).tolist()), keys_hash, data_hash]


def _ranks_text(cp: CPGroup, ranks: list[int]) -> str:
    return f"group rank(s) {ranks} (global rank(s) {[cp.global_rank(r) for r in ranks]})"


def _all_gather_words(cp: CPGroup, words: list[int]) -> list[list[int]]:
    local = torch.tensor(words, dtype=torch.int64, device=cp.device)
    out = [torch.empty_like(local) for _ in range(cp.size)]
    dist.all_gather(out, local, group=cp.group)
    return torch.stack(out).tolist()


def _raise_if_inconsistent(cp: CPGroup, rows: list[list[int]], fields: tuple[str, ...], what: str, fix: str) -> None:
    ref = rows[0]
    differ = [r for r, row in enumerate(rows) if row != ref]
    if not differ:
        return
    details = "; ".join(
        f"group rank {r}: {', '.join(f for f, a, b in zip(fields, rows[r], ref) if a != b)}" for r in differ
    )
    raise ValueError(
        f"check_consistent: the CP group's ranks do not hold the same {what}: {_ranks_text(cp, differ)} differ "
        f"from group rank 0 ({details}); {fix}"
    )


def _local(
    cp: CPGroup, layout: str, check_consistent: bool, tag: int,
    prepare: Callable[[], tuple[PackedSeqParams, dict | None]],
) -> tuple[ShardedPackedSeqParams, dict | None]:
    """Every rank holds the batch: shard locally (and with ``check_consistent`` compare fingerprints)."""
    if not check_consistent:
        params, batch = prepare()
        return shard_packed_seq_params(params, cp_size=cp.size, cp_rank=cp.rank, layout=layout), batch
    error = None
    try:
        params, batch = prepare()
        sharded = shard_packed_seq_params(params, cp_size=cp.size, cp_rank=cp.rank, layout=layout)
        words = [_STATUS_OK, *_fingerprint(tag, params, sharded, batch)]
    except Exception as exc:  # noqa: BLE001 - this rank still joins the all-gather, then raises
        error = exc
        words = [_status_of(exc)] + [0] * len(_FINGERPRINT_FIELDS)
    rows = _all_gather_words(cp, words)
    failed = [r for r, row in enumerate(rows) if row[0] != _STATUS_OK]
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"{_ranks_text(cp, failed)} could not shard their batch (see the error raised there); every rank of the "
            "CP group raises"
        )
    _raise_if_inconsistent(
        cp, [row[1:] for row in rows], _FINGERPRINT_FIELDS, "batch",
        "every rank must pass the same params/batch (seed the data loader per DP rank, not per CP rank), or load it "
        "on one rank and pass src=",
    )
    return sharded, batch


def _check_src_args(cp: CPGroup, tag: int, src: int, layout: str) -> None:
    """check_consistent in the src path: all ranks agree on the call, src and layout (one tiny all-gather)."""
    words = [tag, src, _LAYOUT_CODES.get(layout, _LAYOUT_AUTO)]
    rows = _all_gather_words(cp, words)
    _raise_if_inconsistent(cp, rows, ("call", "src", "layout"), "arguments",
                           "pass the same src and layout on every rank of the CP group")


# --------------------------------------------------------------------------------------------------------------
# Public API


def distribute_packed_seq_params(
    params: PackedSeqParams | None,
    *,
    group: Any = None,
    src: int | None = None,
    layout: str = "zigzag",
    check_consistent: bool = False,
) -> ShardedPackedSeqParams:
    """This rank's ``ShardedPackedSeqParams`` in a CP group, computed locally or shipped from one source rank.

    Args:
        params: the global ``PackedSeqParams`` of the ``[B, S]`` batch. With ``src=None`` every rank passes the same
            one. With ``src`` set only the source's is read; other ranks pass ``None`` (anything they pass is
            ignored).
        group: the CP group: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (``mesh["cp"]``) or ``None`` (default group).
            CP rank = ``dist.get_rank(group)``, CP size = ``dist.get_world_size(group)``.
        src: ``None`` (local sharding, no communication) or the GROUP rank that holds ``params``.
        layout: ``"zigzag"`` (default), ``"contiguous"``, ``"balanced"`` or ``"auto"`` (resolved once, on the source
            or identically on every rank; the result's ``layout`` names it).
        check_consistent: ``src=None``: all-gather a fingerprint (10 int64 per rank; the checksum reads only
            ``cu_seqlens`` and the segment doc indices) and raise on every rank if the ranks' batches differ.
            ``src`` set: all-gather ``(call, src, layout)`` first and raise on every rank if they differ (without it,
            mismatched ``src`` values hang and the source's layout wins).

    Returns:
        ``ShardedPackedSeqParams`` of this rank, equal to ``shard_packed_seq_params(params, cp_size, cp_rank,
        layout)`` field for field. ``src`` path: its tensors (and its rebuilt ``global_params``) live on the group's
        device (CUDA for NCCL, CPU for gloo) on every rank.

    Raises (on EVERY rank of the group, never on one while the others wait):
        TypeError: bad ``group`` / ``src`` / ``check_consistent`` type, or ``params`` not ``PackedSeqParams`` on
            the source (or, with ``src=None``, where it was passed).
        ValueError: ``src`` outside ``[0, cp_size)``, unknown layout, a 2-D mesh, a process outside the group,
            ``B*S`` not a multiple of the CP size, a zigzag segment not a multiple of ``2*cp_size``, and (with
            ``check_consistent``) ranks that disagree: the message names the group and global ranks.

    Communication (``src`` path): two broadcasts, ``HEADER_LEN`` and ``2 * num_segments + 1`` int64.
    """
    cp = resolve_group(group)
    src = _check_src(src, cp)
    _check_layout_arg(layout)
    _check_flag(check_consistent)

    def prepare():
        if not isinstance(params, PackedSeqParams):
            raise TypeError(
                f"params must be PackedSeqParams, got {type(params).__name__}"
                + ("" if src is None else f" on the source rank (src={src})")
                + "; build it with packed_seq_params_from_doc_ids(doc_ids)"
            )
        return params, None

    if src is None:
        return _local(cp, layout, check_consistent, _TAG_PARAMS, prepare)[0]
    if check_consistent:
        _check_src_args(cp, _TAG_PARAMS, src, layout)
    return _from_src(cp, src, layout, _TAG_PARAMS, prepare)[0]


def distribute_batch(
    batch: Mapping[str, torch.Tensor] | None,
    params: PackedSeqParams | None = None,
    *,
    group: Any = None,
    src: int | None = None,
    layout: str = "zigzag",
    check_consistent: bool = False,
) -> tuple[dict[str, torch.Tensor], ShardedPackedSeqParams]:
    """Shard (``src=None``) or scatter from ``src`` a dict of per-token tensors together with its CP metadata.

    Args:
        batch: ``name -> [B, S, ...]`` tensors (``input_ids``, ``labels``, ``position_ids``, masks, embeddings; any
            dtype). Shift labels on the GLOBAL stream before calling (``cp_packing.next_token_labels``). With ``src``
            set only the source's is read: other ranks pass ``None`` (anything they pass is ignored).
        params: the batch's global ``PackedSeqParams``; when ``None`` it is built from ``batch["doc_ids"]``
            (``DOC_IDS_KEY``). Same source rule as ``batch``.
        group, src, layout, check_consistent: as in ``distribute_packed_seq_params`` (``check_consistent`` with
            ``src=None`` also fingerprints every batch tensor: one extra pass over each).

    Returns:
        ``(local_batch, sharded)``: ``local_batch[name]`` is ``[1, T_local, ...]`` (the HF convention: a batch of one
        packed row), this rank's tokens in the layout's order, every key of ``batch`` (``doc_ids`` too when present),
        same dtypes; plus ``"position_ids"`` = ``sharded.position_ids[None]`` (int64, position inside the segment)
        when the batch has none. ``sharded`` is this rank's ``ShardedPackedSeqParams``. Both equal local sharding
        (``sharded.shard(batch[name])[None]``) bit for bit. Devices: local path, each tensor stays on its input's
        device; ``src`` path, everything is on the group's device.

    Raises (on every rank): as ``distribute_packed_seq_params``, plus TypeError for a batch that is not a dict of
    tensors and ValueError for a tensor whose leading shape is not ``[B, S]`` (named) or a missing doc map.

    Communication (``src`` path): two broadcasts (``HEADER_LEN`` int64; ``2 * num_segments + 1`` int64 plus a JSON of
    key names, dtypes and trailing shapes) and one ``dist.scatter`` per key (as bytes) of ``T_local * F * itemsize``
    bytes per rank. Every rank receives only its own tokens.
    """
    cp = resolve_group(group)
    src = _check_src(src, cp)
    _check_layout_arg(layout)
    _check_flag(check_consistent)

    def prepare():
        return _prepare_batch(batch, params)

    if src is None:
        sharded, full = _local(cp, layout, check_consistent, _TAG_BATCH, prepare)
        local_batch = {name: sharded.shard(x).unsqueeze(0) for name, x in full.items()}  # [1, T_local, ...]
    else:
        if check_consistent:
            _check_src_args(cp, _TAG_BATCH, src, layout)
        sharded, local_batch = _from_src(cp, src, layout, _TAG_BATCH, prepare)
    if "position_ids" not in local_batch:
        local_batch["position_ids"] = sharded.position_ids.unsqueeze(0)  # int64 [1, T_local]
    return local_batch, sharded
