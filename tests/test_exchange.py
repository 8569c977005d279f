"""The exchange backend (``backend="exchange"``): every rank receives only the keys its queries need.

References are independent of cp_packing's attention:

* numbers: dense float64 attention per document (``tests/reference.py``: each segment's softmax over a mask:
  causal, the sliding window ``p - w < j <= p``, Gemma 2's ``c * tanh(s / c)``, gpt-oss's sink logit appended to
  every row), differentiated by autograd; and HF's own eager models run per document (``tests/test_hf*.py``);
* bytes: what each rank's queries attend and it does not hold, counted token by token from every rank's
  ``token_index`` (and ``cp_packing.layouts.need.need_tokens``), against the splits each rank hands to
  ``torch.distributed.all_to_all_single`` (wrapped inside the ranks) in forward and backward;
* the schedule: with ``overlap=True`` the local part's kernel runs between the all-to-all's start and its wait.

Every cp size runs ONE set of ranks for all its cases (cached: the tests below read its results).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.agreement import AgreementError
from cp_packing.attention import kernels
from cp_packing.attention.dispatch import context_parallel_attention
from cp_packing.attention.exchange import exchange_tables
from cp_packing.attention.plan import prepare_attention
from cp_packing.layouts import layout_plan
from cp_packing.layouts.need import need_tokens
from cp_packing.testing import rank_device, run_distributed, synthetic_doc_ids
from tests.reference import dense_attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = 8
LAYOUTS = ("contiguous", "zigzag", "balanced", "local")
TOL = 1e-10  # float64, the reference kernel
TIMEOUT = 240.0  # hard limit per set of ranks: a hang fails the test instead of blocking the suite


# ------------------------------------------------------------------------------------------------- reference


def needed_keys(token_index: list[torch.Tensor], cu: torch.Tensor, rank: int, causal: bool, window) -> list[int]:
    """``[cp]``: how many keys rank ``rank``'s queries attend that rank j holds (0 for itself), token by token."""
    T = sum(t.numel() for t in token_index)
    owner = torch.empty(T, dtype=torch.int64)
    for r, t in enumerate(token_index):
        owner[t] = r
    seg = torch.searchsorted(cu.long(), torch.arange(T), right=True) - 1
    needed = torch.zeros(T, dtype=torch.bool)
    for p in token_index[rank].tolist():
        g, e = int(cu[seg[p]]), int(cu[seg[p] + 1])
        lo = max(g, p - window + 1) if (causal and window is not None) else g
        needed[lo:(p + 1 if causal else e)] = True
    needed[token_index[rank]] = False
    return torch.bincount(owner[needed], minlength=len(token_index)).tolist()


# ----------------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One attention layer (forward + backward) on one map, every rank."""

    name: str
    doc: torch.Tensor
    layout: str
    H: int = 4
    H_kv: int = 2
    causal: bool = True
    window: int | None = None
    plan_window: int | None = None  # the window balanced / local are planned for
    softcap: float | None = None
    sinks: bool = False
    overlap: bool = True
    layers: int = 1


def _maps(cp: int) -> dict[str, torch.Tensor]:
    n = 24  # tokens per rank
    return {
        # one row: no row boundary falls on a shard edge
        "lognormal": synthetic_doc_ids("lognormal", 1, n * cp, seed=cp, median=8, pad=0.1),
        "zigzag": synthetic_doc_ids("lognormal", 2, n * cp // 2, seed=cp, median=8, pad=0.1, multiple=2 * cp),
        # one document per rank, ending at the shard edge: no rank needs a remote key
        "aligned": torch.ones(cp, n, dtype=torch.int64),
        # the last rank holds only padding (a segment of its own) and needs nothing; so does rank 0
        "padding rank": torch.tensor([[1] * (n + n // 2) + [2] * ((cp - 2) * n - n // 2) + [0] * n]) if cp > 2 else
        torch.tensor([[1] * n + [0] * n]),
        # every token is padding: one padding segment over all ranks, exchanged like a document
        "all padding": torch.zeros(1, 4 * cp, dtype=torch.int64),
    }


def _layout_cases(layout: str, doc: torch.Tensor) -> list[Case]:
    planned = 3 if layout in ("balanced", "local") else None
    variants = [
        ("base", {}),
        ("serial", {"overlap": False}),
        ("window 3", {"window": 3, "plan_window": planned}),
        ("window 5 serial", {"window": 5, "overlap": False}),
        ("non-causal", {"causal": False}),
        ("non-causal serial", {"causal": False, "overlap": False}),
        ("softcap sinks", {"softcap": 0.8, "sinks": True}),
        ("softcap sinks serial", {"softcap": 0.8, "sinks": True, "overlap": False}),
        ("gqa 4/1", {"H_kv": 1}),
        ("gqa 4/1 window softcap sinks", {"H_kv": 1, "window": 4, "plan_window": planned, "softcap": 0.8,
                                          "sinks": True}),
    ]
    return [Case(f"{layout} {name}", doc, layout, **kw) for name, kw in variants]


def _cases(cp: int) -> list[Case]:
    maps = _maps(cp)
    cases = [c for layout in LAYOUTS for c in _layout_cases(layout, maps["zigzag" if layout == "zigzag" else
                                                                         "lognormal"])]
    return cases + [
        Case("aligned", maps["aligned"], "contiguous"),
        Case("aligned non-causal serial", maps["aligned"], "contiguous", causal=False, overlap=False),
        Case("padding rank", maps["padding rank"], "contiguous"),
        Case("all padding", maps["all padding"], "zigzag"),
        Case("two layers", maps["lognormal"], "local", layers=2),
    ]


# ------------------------------------------------------------------------------------------ the ranks' side

_COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
                "reduce_scatter_tensor", "reduce_scatter", "broadcast", "barrier", "send", "recv", "isend", "irecv",
                "all_gather_object", "broadcast_object_list")


class _Work:
    """An async handle that notes when it is waited for."""

    def __init__(self, work, events):
        self._work, self._events = work, events

    def wait(self, *args, **kwargs):
        self._events.append(("wait",))
        return self._work.wait(*args, **kwargs)


@contextlib.contextmanager
def recorded():
    """Every collective call (all-to-all: its output/input splits, rows and row shape) and every kernel call, in
    order, while the block runs."""
    events: list[tuple] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    saved_kernels = (kernels.run_forward, kernels.run_backward)

    def wrap(name, fn):
        def collective(*args, **kwargs):
            if name == "all_to_all_single":
                out, inp = args[0], args[1]
                out_splits = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
                in_splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
                events.append((name, list(out_splits), list(in_splits), out.shape[0], inp.shape[0],
                               tuple(inp.shape[1:])))
            else:
                events.append((name,))
            work = fn(*args, **kwargs)
            return _Work(work, events) if work is not None else None
        return collective

    def kernel(what, fn):
        def call(*args, **kwargs):
            events.append((what,))
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    kernels.run_forward, kernels.run_backward = kernel("fwd", saved_kernels[0]), kernel("bwd", saved_kernels[1])
    try:
        yield events
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        kernels.run_forward, kernels.run_backward = saved_kernels


def _inputs(case: Case, T: int):
    g = torch.Generator().manual_seed(T + case.H_kv)
    q, k, v, dout = (torch.randn(T, h, D, generator=g, dtype=torch.float64)
                     for h in (case.H, case.H_kv, case.H_kv, case.H))
    return q, k, v, dout, torch.randn(case.H, generator=g, dtype=torch.float64)


def _run_case(case: Case, rank: int, cp: int) -> dict:
    """This rank's errors against the reference, the collectives and kernels it ran, and the expected tables."""
    params = packed_seq_params_from_doc_ids(case.doc)
    shards = [shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout=case.layout, window=case.plan_window)
              for r in range(cp)]
    sharded = shards[rank]
    q, k, v, dout, sinks = _inputs(case, params.total_tokens)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    ref = dense_attention(*leaves[:3], params.cu_seqlens, causal=case.causal, window=case.window,
                             softcap=case.softcap, sinks=leaves[3] if case.sinks else None)
    (ref * dout).sum().backward()

    step = prepare_attention(sharded, group=dist.group.WORLD, backend="exchange", kernel="torch",
                             overlap=case.overlap, causal=case.causal, window=case.window)
    device = rank_device()  # this rank's GPU under torchrun + NCCL, else the CPU
    local = [sharded.shard(x).to(device).requires_grad_() for x in (q, k, v)]
    s = sinks.to(device).requires_grad_()
    with recorded() as events:
        outs = [context_parallel_attention(*local, step, causal=case.causal, window=case.window,
                                           softcap=case.softcap, sinks=s if case.sinks else None)
                for _ in range(case.layers)]
        (sum(outs) * sharded.shard(dout).to(device)).sum().backward()
    errs = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), [outs[0].detach()] + [x.grad / case.layers for x in local],
                               [ref.detach()] + [x.grad for x in leaves[:3]]):
        errs[name] = float((got.cpu() - sharded.shard(want)).abs().max()) if got.numel() else 0.0
    if case.sinks:  # each rank holds its queries' part: the parts summed over the group are the whole gradient
        total = s.grad / case.layers
        dist.all_reduce(total)
        errs["dsinks"] = float((total.cpu() - leaves[3].grad).abs().max())
        errs["dsinks is partial"] = float((s.grad / case.layers - total).abs().max())
    tables = exchange_tables(sharded, causal=case.causal, window=case.window)
    plan = layout_plan(params.cu_seqlens, cp_size=cp, layout=case.layout, window=case.plan_window)
    cu = params.cu_seqlens.long().numpy()
    token_index = [x.token_index for x in shards]
    return {
        "errs": errs, "events": events, "backend": step.plan.backend,
        "send_splits": tables.send_splits, "recv_splits": tables.recv_splits, "communicate": tables.communicate,
        "need_tokens": int(need_tokens(plan, cu, causal=case.causal, window=case.window)[rank]),
        "recv_counted": needed_keys(token_index, params.cu_seqlens, rank, case.causal, case.window),
        "send_counted": [needed_keys(token_index, params.cu_seqlens, r, case.causal, case.window)[rank]
                         for r in range(cp)],
    }


def _mistake_cases(cp: int) -> dict[str, tuple[str, Callable]]:
    """name -> (the field the error must name, ``(rank) -> (doc map, layout, plan_window)``): one rank differs."""
    maps = _maps(cp)
    doc, other = maps["lognormal"], synthetic_doc_ids("lognormal", 1, 24 * cp, seed=cp + 7, median=8, pad=0.1)
    last = cp - 1
    return {
        "another layout": ("layout", lambda r: (doc, "contiguous" if r == 0 else "local", None)),
        "another plan_window (balanced)": ("plan", lambda r: (doc, "balanced", 4 if r == last else None)),
        "another plan_window (local)": ("plan", lambda r: (doc, "local", 4 if r == 0 else None)),
        "another cu_seqlens": ("plan", lambda r: (other if r == last else doc, "local", None)),
    }


def _run_mistake(how, rank: int, cp: int) -> dict:
    doc, layout, plan_window = how(rank)
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=cp, cp_rank=rank, layout=layout,
                                      window=plan_window)
    q, k, v, _, _ = _inputs(Case("", doc, layout), doc.numel())
    with recorded() as events:
        try:  # the step's agreement, before the model runs
            step = prepare_attention(sharded, group=dist.group.WORLD, backend="exchange", kernel="torch")
            context_parallel_attention(*(sharded.shard(x).to(rank_device()) for x in (q, k, v)), step)
        except AgreementError as exc:
            return {"error": str(exc), "events": events}
    return {"error": None, "events": events}


def _dist_exchange(rank: int, world_size: int) -> list[dict]:
    """Every rank's results, on every rank (so that a torchrun launch, where a process sees its own return value
    only, checks the same)."""
    out = {case.name: _run_case(case, rank, world_size) for case in _cases(world_size)}
    out["mistakes"] = {name: _run_mistake(how, rank, world_size)
                       for name, (_, how) in _mistake_cases(world_size).items()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, out)
    return everyone


@functools.cache
def _results(cp: int) -> list[dict]:
    """Every rank's results for every case at this cp size, in rank order (one set of ranks, run once per test
    session; under torchrun, the launched group of that size, else the tests skip)."""
    return run_distributed(_dist_exchange, cp, timeout=TIMEOUT)[0]


# ----------------------------------------------------------------------------------------------------- tests

CPS = [2, 3, 4]


@pytest.mark.distributed
@pytest.mark.parametrize("cp", CPS)
def test_exchange_matches_the_dense_reference_per_document(cp):
    """out, dq, dk, dv (and the sinks' gradient summed over the ranks) equal dense float64 attention per document:
    every layout, windows (planned and not), causal=False, softcap, sinks, GQA down to 1 key/value head, overlap on
    and off, padding ranks, a step with no remote keys, two layers."""
    results = _results(cp)
    names = [case.name for case in _cases(cp)]
    for rank, per_case in enumerate(results):
        assert set(per_case) == {*names, "mistakes"}
        for name in names:
            r = per_case[name]
            assert r["backend"] == "exchange", (name, r["backend"])
            errs = dict(r["errs"])
            partial = errs.pop("dsinks is partial", None)
            assert max(errs.values()) < TOL, f"cp={cp} rank {rank} {name}: {errs}"
            if partial is not None and name != "all padding":
                assert partial > 1e-6, f"cp={cp} rank {rank} {name}: the local sinks gradient is already the total"


def _a2a(events):
    return [e for e in events if e[0] == "all_to_all_single"]


def test_remote_backward_pieces_tile_the_received_keys_with_bounded_size():
    """The remote part's backward runs in at most num_pieces(cp) kernel calls: together they cover every remote key of every
    run once, in order (so each key's dK/dV and each query's dq are whole), none holds more than T_local keys when
    the need allows it; the local part's (overlapped) the same, in whole runs; the op's tables keep their sizes
    from one map to the next (no recompile)."""
    from cp_packing.attention.exchange import from_wire, num_pieces, to_wire

    cp = 4
    sizes = set()
    for seed in (0, 1):
        doc = synthetic_doc_ids("lognormal", 1, 64 * cp, seed=seed, median=64, multiple=2 * cp)
        for rank in range(cp):
            sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=cp, cp_rank=rank,
                                              layout="zigzag")
            t = exchange_tables(sharded)
            wire = to_wire(t)
            sizes.add(tuple(wire[1].shape))
            decoded = from_wire(wire)  # the op's padding to num_pieces(cp) dropped again
            for mine, theirs in ((t.pieces, decoded.pieces), (t.local_pieces, decoded.local_pieces)):
                assert len(mine) <= num_pieces(cp) and all(p.k1 > p.k0 for p in mine)
                assert [(p.q0, p.q1, p.k0, p.k1, p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist()) for p in mine] \
                    == [(p.q0, p.q1, p.k0, p.k1, p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist()) for p in theirs]
            used = list(t.pieces)
            if t.remote is None:
                assert used == []
                continue
            T_local, cu_q, cu_k = sharded.token_index.numel(), t.cu_seqlens_q.tolist(), t.remote.cu_seqlens_k.tolist()
            assert [p.k0 for p in used] == [0] + [p.k1 for p in used[:-1]] and used[-1].k1 == cu_k[-1]
            assert all(p.k1 - p.k0 <= T_local for p in used), [(p.k0, p.k1) for p in used]
            for p in used:  # every run of a piece: its rows, and its keys clipped to the piece
                runs = [i for i in range(len(cu_q) - 1) if cu_q[i] >= p.q0 and cu_q[i + 1] <= p.q1]
                assert p.cu_seqlens_q.tolist() == [cu_q[i] - p.q0 for i in runs] + [p.q1 - p.q0]
                assert p.cu_seqlens_k.tolist() == [min(max(cu_k[i], p.k0), p.k1) - p.k0 for i in runs] + \
                    [min(max(cu_k[runs[-1] + 1], p.k0), p.k1) - p.k0]
            if rank == 0:
                assert len(used) > 1  # zigzag at cp 4: rank 0 needs about 3 ranks' keys
            # the local part (causal calls): whole runs only, every held key of every run once
            local = list(t.local_pieces)
            assert local
            cu_l = t.local.cu_seqlens_k.tolist()
            assert [p.k0 for p in local] == [0] + [p.k1 for p in local[:-1]] and local[-1].k1 == cu_l[-1]
            for p in local:
                runs = [i for i in range(len(cu_q) - 1) if cu_q[i] >= p.q0 and cu_q[i + 1] <= p.q1]
                assert (p.k0, p.k1) == (cu_l[runs[0]], cu_l[runs[-1] + 1])
                assert p.k1 - p.k0 <= T_local or len(runs) == 1
    assert len(sizes) == 1, sizes


@pytest.mark.distributed
@pytest.mark.parametrize("cp", CPS)
def test_rows_moved_are_exactly_the_needed_keys(cp):
    """Per layer, forward: one all-to-all receiving from every rank exactly the keys this rank's queries attend that
    rank holds (counted token by token), sending what the others need of this rank's, K and V together; backward:
    the same exchange again (nothing received is kept for backward), then the splits reversed (each received key's
    dK/dV back to its owner). The step plan's tables and need_tokens
    say the same. No other collective runs."""
    results = _results(cp)
    moved = {layout: 0 for layout in LAYOUTS}
    for case in _cases(cp):
        for rank, per_case in enumerate(results):
            r = per_case[case.name]
            where = f"cp={cp} rank {rank} {case.name}"
            assert r["recv_splits"] == r["recv_counted"], where
            assert r["send_splits"] == r["send_counted"], where
            assert sum(r["recv_splits"]) == r["need_tokens"], where
            assert r["recv_splits"][rank] == r["send_splits"][rank] == 0, where
            assert {e[0] for e in r["events"]} <= {"all_to_all_single", "wait", "fwd", "bwd"}, (where, r["events"])
            calls = _a2a(r["events"])
            if not r["communicate"]:
                assert calls == [], where
                continue
            rows = (2, case.H_kv, D)  # K and V of a token travel together
            fwd = ("all_to_all_single", r["recv_splits"], r["send_splits"], sum(r["recv_splits"]),
                   sum(r["send_splits"]), rows)
            bwd = ("all_to_all_single", r["send_splits"], r["recv_splits"], sum(r["send_splits"]),
                   sum(r["recv_splits"]), rows)
            assert calls == [fwd] * case.layers + [fwd, bwd] * case.layers, (where, calls)
            if case.layout in moved:
                moved[case.layout] += sum(r["recv_splits"])
    assert all(moved.values()), moved  # every layout's cases exchanged something: the checks above can fail


@pytest.mark.distributed
@pytest.mark.parametrize("cp", CPS)
def test_overlap_runs_the_local_part_while_the_keys_travel(cp):
    """With overlap (no window), where this rank receives keys: forward = all-to-all, the local kernel, wait, the
    remote kernel; backward = the all-to-all again, the local backward, wait, the remote part's backward, then the
    gradients' all-to-all. Serialized (or under a window): wait before the one kernel call (a backward part with
    more keys than queries runs per key/value head under GQA: consecutive calls count as one)."""
    results = _results(cp)
    serial_backward = ["all_to_all_single", "wait", "bwd", "all_to_all_single", "wait"]
    for case in _cases(cp):
        for rank, per_case in enumerate(results):
            r = per_case[case.name]
            if not r["communicate"] or case.layers > 1:
                continue
            kinds = [e[0] for e in r["events"]]
            # a part's backward may run one key/value head at a time (kernels.run_backward_per_kv_head): one call
            kinds = [k for i, k in enumerate(kinds) if k != "bwd" or i == 0 or kinds[i - 1] != "bwd"]
            where = f"cp={cp} rank {rank} {case.name}: {kinds}"
            if sum(r["recv_splits"]) == 0:  # nothing to attend remotely: one kernel call each way
                assert kinds == ["all_to_all_single", "wait", "fwd", *serial_backward], where
            elif case.overlap and case.window is None:
                assert kinds == ["all_to_all_single", "fwd", "wait", "fwd",
                                 "all_to_all_single", "bwd", "wait", "bwd", "all_to_all_single", "wait"], where
            else:
                assert kinds == ["all_to_all_single", "wait", "fwd", *serial_backward], where


@pytest.mark.distributed
@pytest.mark.parametrize("cp", CPS)
def test_ranks_without_remote_keys_join_or_skip_together(cp):
    """A rank that needs no remote key (rank 0 of contiguous, an all-padding rank) still joins the three all-to-alls
    (forward, and backward's keys and gradients) when any rank needs one; a step where no rank needs a remote key runs no collective on any rank."""
    results = _results(cp)
    for rank in range(cp):
        assert not results[rank]["aligned"]["communicate"] and _a2a(results[rank]["aligned"]["events"]) == []
        assert _a2a(results[rank]["aligned non-causal serial"]["events"]) == []
        base = results[rank]["contiguous base"]
        assert base["communicate"] and len(_a2a(base["events"])) == 3
        assert len(_a2a(results[rank]["all padding"]["events"])) == 3
    assert sum(results[0]["contiguous base"]["recv_splits"]) == 0  # rank 0 needs nothing, yet it took part
    padding = [results[r]["padding rank"] for r in range(cp)]
    assert sum(padding[-1]["recv_splits"]) == 0 and sum(padding[-1]["send_splits"]) == 0
    # cp 2: the padding rank's neighbour needs nothing either, so nothing runs; cp > 2: rank 1 needs rank 0's keys
    assert all(p["communicate"] == (cp > 2) for p in padding)
    assert all(len(_a2a(p["events"])) == (3 if cp > 2 else 0) for p in padding)


@pytest.mark.distributed
@pytest.mark.parametrize("cp", CPS)
def test_a_one_rank_mistake_in_the_tables_inputs_is_raised_on_every_rank(cp):
    """One rank shards with another layout, plans balanced / local for another window, or has another batch: every
    rank raises the same AgreementError naming the field, before any collective (never a hang)."""
    results = _results(cp)
    for name, (field, _) in _mistake_cases(cp).items():
        messages = {results[rank]["mistakes"][name]["error"] for rank in range(cp)}
        assert None not in messages, f"cp={cp} {name}: some rank did not raise"
        assert len(messages) == 1, (name, messages)  # the same error everywhere
        assert f"disagree on {field}" in messages.pop(), name
        assert all(_a2a(results[rank]["mistakes"][name]["events"]) == [] for rank in range(cp)), name


def test_cp1_runs_without_a_process_group():
    """cp_size 1: nothing to exchange, no group needed; equal to the dense reference."""
    case = Case("cp1", synthetic_doc_ids("lognormal", 2, 20, seed=1, median=8, pad=0.1), "contiguous",
                softcap=0.8, sinks=True)
    params = packed_seq_params_from_doc_ids(case.doc)
    sharded = shard_packed_seq_params(params, cp_size=1, cp_rank=0)
    q, k, v, _, sinks = _inputs(case, params.total_tokens)
    ref = dense_attention(q, k, v, params.cu_seqlens, softcap=0.8, sinks=sinks)
    with recorded() as events:
        out = context_parallel_attention(q, k, v, sharded, backend="exchange", kernel="torch", softcap=0.8,
                                         sinks=sinks)
    assert (out - ref).abs().max() < TOL
    assert [e[0] for e in events] == ["fwd"]


# ------------------------------------------------------------------------------------------------ HF models


def _hf_cases(cp: int):
    """(kind, layout, case): Llama, Qwen2 (sliding layers), Gemma 2 (softcap), gpt-oss (sinks), every layout."""
    from tests import test_hf, test_hf_models

    return [(kind, layout, (test_hf.make_case if kind == "llama" else test_hf_models.make_case)(layout, cp))
            for kind in ("llama", "qwen2", "gemma2", "gpt_oss") for layout in LAYOUTS]


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hf_models_match_documents_alone(cp):
    """cp_model_inputs(..., backend="exchange"): the loss shares sum to the reference loss, SUM-reduced gradients
    (gpt-oss's sinks included) and every token's logits equal HF eager's (Llama: the block-diagonal masked model
    and each document alone; the windowed families: each document alone, HF's own window, softcap and sinks)."""
    pytest.importorskip("transformers")
    from tests import test_hf, test_hf_models

    models = {"llama": test_hf.make_model("llama", test_hf.NAME)}
    models.update({kind: test_hf_models.make_model(kind, test_hf_models.NAME) for kind in ("qwen2", "gemma2",
                                                                                           "gpt_oss")})
    cases = _hf_cases(cp)
    results = run_distributed(test_hf._parity_worker, cp, models, cases, "exchange", timeout=TIMEOUT)
    assert set(results[0]) == {(kind, layout) for kind, layout, _ in cases}
    llama = [c for c in cases if c[0] == "llama"]
    test_hf._check_parity(cp, llama, results)
    for kind, layout, case in cases:
        if kind == "llama":
            continue
        got = results[0][(kind, layout)]
        sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(case["doc"]), cp_size=cp, cp_rank=0,
                                          layout=layout)
        logits = sharded.unshard([torch.from_numpy(x) for x in got["logits"]]).reshape(*case["doc"].shape, -1)
        if case["padded"] is not None:
            logits = case["padded"].unpad(logits)
        assert sum(abs(x) > 0 for x in got["shares"]) >= 2  # genuine shares
        loss = torch.tensor(sum(got["shares"]), dtype=torch.float32)
        test_hf_models._compare(logits.reshape(-1, logits.shape[-1]), loss,
                                {n: torch.from_numpy(x) for n, x in got["grads"].items()},
                                test_hf_models.reference(kind, layout == "zigzag"), case["base"])


# ------------------------------------------------------------------------------------------------ benchmarks


def _bench(name: str, *args: str) -> str:
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", name), *(args or ("--quick",))], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.slow
def test_bench_exchange_overlap_quick_runs():
    """The overlap benchmark's smoke run: a row for cp 2 with positive times and hidden fractions in [0, 1]."""
    out = _bench("bench_exchange_overlap.py")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["cp=2"]]
    assert len(rows) == 1 and len(rows[0]) == 12, out
    *times, corrected, hidden = (float(x) for x in rows[0][5:])
    assert all(t > 0 for t in times) and 0 <= corrected <= 1 and 0 <= hidden <= 1, out
    assert 0 < int(rows[0][3]) and 0 < float(rows[0][4]) < 1, out  # the exchange moved a share of the stream


@pytest.mark.slow
def test_bench_cp_attention_gpu_quick_runs():
    """The GPU benchmark's CPU smoke run: every backend that can run at cp 2 (all-gather, exchange, Ulysses) gives
    positive TFLOP/s on its own layout for both maps; hybrid and the float32 ring are listed as skipped."""
    out = _bench("bench_cp_attention_gpu.py")
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| 2 |")]
    assert sorted((row[1], row[2], row[3]) for row in rows) == sorted(
        (mean, backend, layout) for mean in ("32", "128")
        for backend, layout in (("allgather", "balanced"), ("exchange", "local"), ("ulysses", "balanced"))), out
    assert all(float(x) > 0 for row in rows for x in row[4:]), out  # the model's time, then the measured ones
    assert "skipped: hybrid" in out and "skipped: ring_flash_attn" in out, out


@pytest.mark.slow
def test_bench_cp_attention_gpu_model_only_runs():
    """``--model-only`` prints the step-time model's table (no ranks): one row per cp, map and layout."""
    out = _bench("bench_cp_attention_gpu.py", "--model-only", "--cps", "2,4", "--tokens", "256", "--heads", "4",
                 "--kv-heads", "2", "--head-dim", "8")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith(("| 2 |", "| 4 |"))]
    assert len(rows) == 2 * 2 * 2 and {row[-1].strip() for row in rows} <= {"allgather", "exchange", "ulysses"}
