"""Logit soft-capping (``softcap``) and attention sinks (``sinks``): kernels, CP backends and their errors.

The reference is dense float64 attention (``tests/reference.py``) from the definitions HF's eager attention uses
(Gemma 2: ``scores = softcap * tanh(scale * q.k / softcap)``, then the mask; gpt-oss: one sink logit per head
appended to every row's logits, softmax, the sink column dropped), differentiated by autograd. Nothing of the
varlen kernels is reused in it.
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.attention import kernels
from cp_packing.attention.dispatch import context_parallel_attention, select_backend
from cp_packing.attention.kernels import (
    select_kernel,
    sink_grad,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)
from cp_packing.testing import run_distributed
from tests.reference import dense_attention
from tests.test_kernels import flash_stub  # noqa: F401 - the pure-torch flash_attn stand-in fixture


def _inputs(seed=0, dtype=torch.float64, H=4, H_kv=2, D=4):
    """Two sequences with more keys than queries (bottom-right mask) and a third with fewer (empty rows)."""
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 10, 12], dtype=torch.int32)
    q = torch.randn(12, H, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(12, H_kv, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(12, H_kv, D, generator=g, dtype=torch.float64).to(dtype)
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    return q, k, v, cu_q, cu_k, sinks


OPTIONS = [
    {"softcap": 0.7},
    {"sinks": True},
    {"softcap": 1.5, "sinks": True},
    {"softcap": 0.7, "sinks": True, "window": 2},
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "+".join(o))
def test_reference_kernel_matches_the_dense_definition_with_gradients(opts):
    """out, lse and the gradients of q, k, v and the sinks equal autograd of the dense float64 definition."""
    q, k, v, cu_q, cu_k, sinks = _inputs()
    sinks = sinks if opts.get("sinks") else None
    kw = {"softcap": opts.get("softcap"), "window": opts.get("window")}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None
                                                                else [])
    ref = dense_attention(*leaves[:3], cu_q, cu_k, sinks=leaves[3] if sinks is not None else None, **kw)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * dout).sum(), leaves)

    got_leaves = [x.clone().requires_grad_() for x in leaves]
    out = varlen_attention(*got_leaves[:3], cu_q, cu_k, 5, 5, kernel="torch",
                           sinks=got_leaves[3] if sinks is not None else None, **kw)
    grads = torch.autograd.grad((out * dout).sum(), got_leaves)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")

    # lse includes the sink: exp(sink - lse) is the sink's share of each row's softmax, in (0, 1)
    _, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, 5, 5, kernel="torch",
                                      sinks=sinks, **kw)
    if sinks is not None:
        share = torch.exp(sinks[:, None] - lse)
        assert ((share > 0) & (share <= 1)).all()
        # the third sequence has 4 queries and 2 keys: its first two queries attend only the sink
        torch.testing.assert_close(lse[:, 8:10], sinks[:, None].expand(-1, 2))


def test_gradcheck_through_tanh_and_sinks():
    """torch.autograd.gradcheck of the differentiable wrapper (q, k, v and sinks) with softcap, GQA, a window and
    empty rows, on tiny float64 inputs."""
    q, k, v, cu_q, cu_k, sinks = _inputs(seed=1, H=2, H_kv=1, D=3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    fn = lambda q, k, v, s: varlen_attention(q, k, v, cu_q, cu_k, 5, 5, kernel="torch",  # noqa: E731
                                             softcap=0.9, sinks=s, window=3)
    assert torch.autograd.gradcheck(fn, leaves)


def test_sink_grad_is_additive_over_query_splits():
    """The sinks' gradient of a split of the queries (as CP ranks hold them) sums to that of all the queries."""
    q, k, v, cu_q, cu_k, sinks = _inputs(seed=2)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, 5, 5, kernel="torch", sinks=sinks, softcap=2.0)
    dout = torch.randn_like(out)
    whole = sink_grad(dout, out, lse, sinks)
    parts = sum(sink_grad(dout[a:b], out[a:b], lse[:, a:b], sinks) for a, b in ((0, 5), (5, 12)))
    torch.testing.assert_close(parts, whole)
    assert whole.abs().min() > 0


def test_half_precision_inputs_with_a_float32_sink_parameter():
    """bf16 q/k/v with float32 sinks (a float32 parameter under autocast) run; the sinks' gradient is float32."""
    q, k, v, cu_q, cu_k, sinks = _inputs(seed=3)
    ref = dense_attention(q, k, v, cu_q, cu_k, softcap=1.0, sinks=sinks)
    leaves = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    s = sinks.float().requires_grad_()
    out = varlen_attention(*leaves, cu_q, cu_k, 5, 5, softcap=1.0, sinks=s)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert s.grad.dtype == torch.float32 and torch.isfinite(s.grad).all()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)


# ---------------------------------------------------------------------------------------------------- kernels


def test_sinks_on_the_flash_attn_path_through_the_stand_in(flash_stub):  # noqa: F811
    """kernel='flash_attn' takes sinks by rescaling the kernel's out/lse (the stand-in has flash-attn's
    conventions: +inf lse for empty rows, backward from the given out/lse): equal to the reference kernel."""
    q, k, v, cu_q, cu_k, sinks = _inputs(seed=4, dtype=torch.float32)
    dout = torch.randn_like(q)
    results = {}
    for kernel in ("torch", "flash_attn"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks.float())]
        out = varlen_attention(*leaves[:3], cu_q, cu_k, 5, 5, kernel=kernel, sinks=leaves[3])
        results[kernel] = [out, *torch.autograd.grad((out * dout).sum(), leaves)]
    for got, want in zip(results["flash_attn"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_softcap_reaches_flash_attn_forward_and_backward(flash_stub, monkeypatch):  # noqa: F811
    """kernel='flash_attn' passes softcap= to flash-attn's forward and backward (0.0 without one), and the result
    is the soft-capped attention (the stand-in is wrapped to compute it with the reference kernel)."""
    seen = []

    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
        seen.append(("fwd", softcap))
        out, lse = varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale=softmax_scale, causal=causal, kernel="torch",
                                            softcap=softcap or None)
        return out, lse.masked_fill(torch.isneginf(lse), float("inf")), None, None

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                 alibi_slopes, deterministic, rng_state=None):
        seen.append(("bwd", softcap))
        lse = softmax_lse.masked_fill(torch.isposinf(softmax_lse), float("-inf"))
        for dst, src in zip((dq, dk, dv), varlen_attention_backward(
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale=softmax_scale, causal=causal, kernel="torch", softcap=softcap or None)):
            dst.copy_(src)

    monkeypatch.setattr(flash_stub, "_flash_attn_varlen_forward", forward)
    monkeypatch.setattr(flash_stub, "_flash_attn_varlen_backward", backward)
    q, k, v, cu_q, cu_k, _ = _inputs(seed=5, dtype=torch.float32, D=8)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attention(*leaves, cu_q, cu_k, 5, 5, kernel="flash_attn", softcap=0.8)
    out.sum().backward()
    assert seen == [("fwd", 0.8), ("bwd", 0.8)]
    ref = dense_attention(q, k, v, cu_q, cu_k, softcap=0.8)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    seen.clear()
    varlen_attention_forward(q, k, v, cu_q, cu_k, 5, 5, kernel="flash_attn")
    assert seen == [("fwd", 0.0)]


def test_flash_attn_without_a_softcap_argument_is_refused(monkeypatch):
    """flash-attn < 2.6 has no softcap argument: a softcap is refused, not silently dropped."""
    def old_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, window_size, alibi_slopes, return_softmax):
        raise AssertionError("must not be called")

    assert "softcap" not in inspect.signature(old_forward).parameters
    fake = type(sys)("fake_flash_attn_interface")
    fake._flash_attn_varlen_forward = old_forward
    monkeypatch.setattr(kernels, "_flash_attn_interface", lambda: fake)
    q, k, v, cu_q, cu_k, _ = _inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"no softcap argument \(added in 2.6\)"):
        varlen_attention_forward(q, k, v, cu_q, cu_k, 5, 5, kernel="flash_attn", softcap=30.0)


def test_auto_kernel_skips_torch_varlen_for_softcap(monkeypatch):
    monkeypatch.setattr(kernels, "_flash_attn_interface", lambda: None)
    monkeypatch.setattr(kernels, "_torch_varlen_attn", lambda: object())
    assert select_kernel("cuda", torch.bfloat16) == "torch_varlen"
    assert select_kernel("cuda", torch.bfloat16, softcap=True) == "torch"  # the reference: it can soft-cap
    monkeypatch.setattr(kernels, "_flash_attn_interface", lambda: object())
    assert select_kernel("cuda", torch.bfloat16, softcap=True) == "flash_attn"


# ------------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("softcap, exc, match", [
    (0.0, ValueError, "softcap must be a finite number > 0"),
    (-1.0, ValueError, "softcap must be a finite number > 0"),
    (float("inf"), ValueError, "softcap must be a finite number > 0"),
    (True, TypeError, "softcap must be a number"),
    ("30", TypeError, "softcap must be a number"),
])
def test_bad_softcap_is_refused(softcap, exc, match):
    q, k, v, cu_q, cu_k, _ = _inputs()
    with pytest.raises(exc, match=match):
        varlen_attention_forward(q, k, v, cu_q, cu_k, 5, 5, softcap=softcap)
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(torch.tensor([[1] * 12])), cp_size=1,
                                      cp_rank=0)
    with pytest.raises(exc, match=match):
        context_parallel_attention(q, k, v, sharded, softcap=softcap)


@pytest.mark.parametrize("sinks, exc, match", [
    (torch.zeros(3), ValueError, r"sinks must have shape \[H\] = \[4\]"),
    (torch.zeros(1, 4), ValueError, r"sinks must have shape \[H\] = \[4\]"),
    (torch.zeros(4, dtype=torch.int64), TypeError, "sinks must be a floating-point tensor"),
    ([0.0] * 4, TypeError, "sinks must be a floating torch.Tensor"),
    (torch.zeros(4, device="meta"), ValueError, "move the sinks to q's device"),
])
def test_bad_sinks_are_refused(sinks, exc, match):
    q, k, v, cu_q, cu_k, _ = _inputs()
    with pytest.raises(exc, match=match):
        varlen_attention(q, k, v, cu_q, cu_k, 5, 5, sinks=sinks)
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(torch.tensor([[1] * 12])), cp_size=1,
                                      cp_rank=0)
    with pytest.raises(exc, match=match):
        context_parallel_attention(q, k, v, sharded, sinks=sinks)


def test_backends_and_kernels_that_cannot_do_it_refuse_and_auto_avoids_them(monkeypatch):
    q, k, v, cu_q, cu_k, sinks = _inputs()
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(torch.tensor([[1] * 12])), cp_size=1,
                                      cp_rank=0)
    for what, kw in (("softcap=30.0", {"softcap": 30.0}), ("attention sinks", {"sinks": sinks})):
        with pytest.raises(NotImplementedError, match=f"ring_flash_attn' cannot run {what}"):
            context_parallel_attention(q, k, v, sharded, backend="ring_flash_attn", **kw)
    with pytest.raises(ValueError, match="kernel='torch_varlen' cannot soft-cap"):
        varlen_attention_forward(q, k, v, cu_q, cu_k, 5, 5, kernel="torch_varlen", softcap=30.0)
    with pytest.raises(ValueError, match="kernel='torch_varlen' cannot soft-cap"):
        context_parallel_attention(q, k, v, sharded, kernel="torch_varlen", softcap=30.0)
    # "auto" would take the ring here (pretend CUDA bf16 + an importable ring); not with softcap or sinks
    from cp_packing.attention import plan

    monkeypatch.setattr(plan, "_auto_wants_ring", lambda *a: True)
    monkeypatch.setattr(plan, "_ring_importable", lambda: True)
    assert select_backend(q, sharded)[0] == "ring_flash_attn"
    assert select_backend(q, sharded, softcap=30.0)[0] == "allgather"
    assert select_backend(q, sharded, sinks=True)[0] == "allgather"


# ------------------------------------------------------------------------------------------ CP backends (gloo)


def _backends(world_size):
    return [("allgather", None), ("ulysses", None)] + ([("hybrid", 2)] if world_size == 4 else [])


def _dist_cp(rank, world_size):
    """Every backend x layout x option on this rank: errors of out, dq, dk, dv (sharded) and of the sinks'
    gradient after a SUM all-reduce over the CP group, against the dense float64 definition."""
    import torch.distributed as dist

    m = 2 * world_size
    maps = {"contiguous": torch.tensor([[1] * 7 + [2] * 9 + [0] * 4 + [3] * 4, [1] * 3 + [2] * 21]),
            "zigzag": torch.tensor([[1] * (2 * m) + [2] * m, [0] * m + [1] * (2 * m)]),
            "balanced": torch.tensor([[1] * 13 + [2] * 5 + [3] * 6, [1] * 24])}
    errs = {}
    for layout, doc in maps.items():
        params = packed_seq_params_from_doc_ids(doc)
        sharded = shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout=layout)
        T = doc.numel()
        g = torch.Generator().manual_seed(T)
        q, k, v, dout = (torch.randn(T, h, 4, generator=g) for h in (4, 2, 2, 4))
        sinks = torch.randn(4, generator=g)
        for softcap, with_sinks, window in ((0.8, True, None), (None, True, None), (1.5, False, None),
                                            (0.8, True, 5)):
            ref_leaves = [x.double().requires_grad_() for x in (q, k, v, sinks)]
            ref = dense_attention(*ref_leaves[:3], params.cu_seqlens, softcap=softcap, window=window,
                                  sinks=ref_leaves[3] if with_sinks else None)
            ref_grads = torch.autograd.grad((ref * dout.double()).sum(), ref_leaves, allow_unused=True)
            for backend, ulysses_size in _backends(world_size):
                if window is not None and backend != "allgather":
                    continue
                local = [sharded.shard(x).detach().requires_grad_() for x in (q, k, v)]
                s = sinks.clone().requires_grad_()
                out = context_parallel_attention(*local, sharded, group=dist.group.WORLD, backend=backend,
                                                 ulysses_size=ulysses_size, softcap=softcap, window=window,
                                                 sinks=s if with_sinks else None)
                (out * sharded.shard(dout)).sum().backward()
                e = {name: float((got.detach().double() - sharded.shard(want)).abs().max())
                     for name, got, want in zip(("out", "dq", "dk", "dv"), [out] + [x.grad for x in local],
                                                [ref.detach(), *ref_grads[:3]])}
                if with_sinks:
                    ds = s.grad.clone()
                    dist.all_reduce(ds)
                    e["dsinks"] = float((ds.double() - ref_grads[3]).abs().max())
                    e["dsinks_local_is_partial"] = bool((s.grad - ds).abs().max() > 0)
                errs[(layout, backend, softcap, with_sinks, window)] = e
    return errs


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_backends_match_the_dense_definition(cp_size):
    """allgather (every option, windows too), ulysses and hybrid (softcap and sinks) at cp 2 and 4, every layout,
    GQA 4/2 heads, float32: out, dq, dk, dv equal the dense float64 definition, and the sinks' gradients of the
    ranks (each its own part, not the whole) sum to the sinks' gradient of the whole batch."""
    per_rank = run_distributed(_dist_cp, cp_size)
    for rank, errs in enumerate(per_rank):
        assert len(errs) == 3 * (3 * len(_backends(cp_size)) + 1)
        for case, e in errs.items():
            partial = e.pop("dsinks_local_is_partial", True)
            assert partial, f"rank {rank} {case}: the local sinks gradient is already the total"
            assert max(e.values()) < 2e-5, f"cp={cp_size} rank {rank} {case}: {e}"
