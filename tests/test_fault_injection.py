"""Fault injection: one rank's mistake is raised on EVERY rank of the CP group, within seconds; never a hang in a
collective, never a gloo abort, never a silently wrong answer.

Each scenario runs on a real gloo group with a hard timeout (the runner fails the test when a rank does not
finish), and asserts that every rank raised the same error type with a message that names the problem.
"""

from __future__ import annotations

import pytest
import torch

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.attention import context_parallel_attention
from cp_packing.testing import run_distributed

pytestmark = pytest.mark.distributed

TIMEOUT = 90.0  # seconds for a whole scenario (a hang would wait for the group's 150 s store timeout)

_DOC_IDS = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * 9 + [2] * 5 + [0] * 2])


def _qkv(T: int, heads: int = 2, kv_heads: int = 2, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, heads, 8, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, 8, generator=g).to(dtype)
    return q, k, k.clone()


def _attention_case(rank: int, world: int, case: str):
    params = packed_seq_params_from_doc_ids(_DOC_IDS)
    layout, cp_rank, heads, dtype, kw = "contiguous", rank, 2, torch.float32, {}
    if case == "wrong_cp_rank" and rank == 1:
        cp_rank = 0  # the DP x CP mesh mistake: the global rank's view instead of the CP rank
    if case == "layout" and rank == 1:
        layout = "balanced"
    if case == "heads" and rank == 0:
        heads = 4
    if case == "bytes_match" and rank == 1:
        heads, dtype = 4, torch.bfloat16  # float32 x 2 heads and bfloat16 x 4 heads: the same byte count
    if case == "causal" and rank == 1:
        kw["causal"] = False
    if case == "kernel" and rank == 0:
        kw["kernel"] = "no_such_kernel"
    sharded = shard_packed_seq_params(params, cp_size=world, cp_rank=cp_rank, layout=layout)
    q, k, v = (sharded.shard(x) for x in _qkv(params.total_tokens, heads=heads, dtype=dtype))
    if case == "tokens" and rank == 1:
        q, k, v = q[:-1], k[:-1], v[:-1]
    try:
        out = context_parallel_attention(q, k, v, sharded, **kw)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)
    return "ok", tuple(out.shape)


@pytest.mark.parametrize(
    "case, kind, words",
    [
        ("wrong_cp_rank", "ValueError", "cp_rank=0 but this process is rank 1"),
        ("layout", "AgreementError", "disagree on layout"),
        ("heads", "AgreementError", "disagree on shapes"),
        ("bytes_match", "AgreementError", "disagree on shapes"),
        ("tokens", "ValueError", "T_local"),
        ("causal", "AgreementError", "disagree on causal"),
        ("kernel", "ValueError", "unknown attention kernel 'no_such_kernel'"),
    ],
)
def test_attention_mistake_on_one_rank_is_raised_on_every_rank(case, kind, words):
    results = run_distributed(_attention_case, 2, case, timeout=TIMEOUT)
    assert [r[0] for r in results] == [kind, kind], results
    assert all(words in r[1] for r in results), results


def test_attention_agreement_runs_once_per_step():
    """One agreement per prepared step (when it is prepared, before any layer), not one per layer; in the first steps
    (check_layers) every layer adds its own small one."""
    def fn(rank, world):
        from cp_packing import agreement
        from cp_packing.attention import prepare_attention

        calls = []
        real = agreement.agree

        def counting(*args, **kwargs):
            calls.append(args[1])
            return real(*args, **kwargs)

        agreement.agree = counting  # fail_together agrees through it
        params = packed_seq_params_from_doc_ids(_DOC_IDS)
        shard = lambda: shard_packed_seq_params(params, cp_size=world, cp_rank=rank, layout="balanced")  # noqa: E731
        q, k, v = (shard().shard(x) for x in _qkv(params.total_tokens))
        step = prepare_attention(shard(), check_layers=False)
        for _ in range(4):  # four layers
            context_parallel_attention(q, k, v, step)
        context_parallel_attention(q, k, v, prepare_attention(shard(), check_layers=False))  # the next step
        checked = prepare_attention(shard(), check_layers=True)  # (the default for the first two steps of a group)
        for _ in range(3):
            context_parallel_attention(q, k, v, checked)
        return calls

    for calls in run_distributed(fn, 2, timeout=TIMEOUT):
        assert calls == ["context_parallel_attention"] * 3 + ["attention layer"] * 3
