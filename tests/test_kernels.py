"""The varlen attention kernel API (cp_packing.attention.kernels) and the test-only flash_attn stand-in.

The reference kernel is checked against an independent dense implementation (``tests/reference.py``: a mask per
segment built from cu_seqlens, plain softmax, gradients from torch.autograd), in float64 so that agreement is
exact up to rounding.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_packing.attention import kernels
from cp_packing.attention.kernels import (
    available_kernels,
    select_kernel,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)
from tests.reference import dense_attention

STUB_DIR = os.path.join(os.path.dirname(__file__), "flash_attn_stub")


# ----------------------------------------------------------------------------------------------------- helpers


@st.composite
def varlen_cases(draw, max_seqs=4, max_len=7):
    """Random varlen metadata (empty sequences, q/k length mismatches, tokens outside cu_seqlens) and shapes."""
    n = draw(st.integers(0, max_seqs))
    lens_q = draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    same = draw(st.booleans())
    lens_k = list(lens_q) if same else draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    tail_q, tail_k = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    H_kv = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 2]))
    D = draw(st.sampled_from([3, 8]))
    causal = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return lens_q, lens_k, tail_q, tail_k, H_kv * G, H_kv, D, causal, seed


def make_case(lens_q, lens_k, tail_q, tail_k, H, H_kv, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + torch.tensor(lens_q, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    Tq, Tk = int(cu_q[-1]) + tail_q, int(cu_k[-1]) + tail_k
    q = torch.randn(Tq, H, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(Tk, H_kv, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(Tk, H_kv, D, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(Tq, H, D, generator=g, dtype=torch.float64).to(dtype)
    max_q = max(lens_q, default=0)
    max_k = max(lens_k, default=0)
    return q, k, v, dout, cu_q, cu_k, max_q, max_k


def dense_grads(q, k, v, dout, cu_q, cu_k, causal, scale=None):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = dense_attention(q, k, v, cu_q, cu_k, causal=causal, scale=scale, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.double(), allow_unused=True)
    return out.detach(), lse.detach(), dq, dk, dv


@pytest.fixture
def flash_stub(monkeypatch):
    """The pure-torch flash_attn stand-in on sys.path for one test; removed from sys.modules afterwards if this
    fixture was the one that imported it."""
    had = {name: sys.modules[name] for name in ("flash_attn", "flash_attn.flash_attn_interface") if name in sys.modules}
    monkeypatch.syspath_prepend(STUB_DIR)
    import flash_attn.flash_attn_interface as fai

    assert getattr(sys.modules["flash_attn"], "IS_CP_PACKING_STUB", False), "a real flash_attn shadows the stub"
    yield fai
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        if name not in had:
            sys.modules.pop(name, None)


# --------------------------------------------------------------------------------------- reference vs dense


@settings(max_examples=50, deadline=None)
@given(varlen_cases())
def test_reference_forward_matches_dense_attention(case):
    lens_q, lens_k, tail_q, tail_k, H, H_kv, D, causal, seed = case
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_case(lens_q, lens_k, tail_q, tail_k, H, H_kv, D, seed)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel="torch")
    ref_out, ref_lse = dense_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (H, q.shape[0])
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "empty rows must be exactly the -inf rows"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-12, rtol=1e-10)


@settings(max_examples=50, deadline=None)
@given(varlen_cases())
def test_reference_backward_matches_autograd_of_dense_attention(case):
    lens_q, lens_k, tail_q, tail_k, H, H_kv, D, causal, seed = case
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_case(lens_q, lens_k, tail_q, tail_k, H, H_kv, D, seed)
    _, _, rdq, rdk, rdv = dense_grads(q, k, v, dout, cu_q, cu_k, causal)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel="torch")
    dq, dk, dv = varlen_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal, kernel="torch"
    )
    assert dk.shape == k.shape and dv.shape == v.shape  # GQA grads come back with the k/v head count
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
        want = torch.zeros_like(got) if want is None else want
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-9)

    # the autograd wrapper gives the same gradients
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    varlen_attention(qa, ka, va, cu_q, cu_k, max_q, max_k, causal=causal, kernel="torch").backward(dout)
    torch.testing.assert_close(qa.grad, dq, atol=0, rtol=0)
    torch.testing.assert_close(ka.grad, dk, atol=0, rtol=0)
    torch.testing.assert_close(va.grad, dv, atol=0, rtol=0)


def test_autograd_wrapper_passes_gradcheck_with_gqa_empty_rows_and_bottom_right_mask():
    cu_q = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 6, 10], dtype=torch.int32)  # k longer, k shorter (empty rows), equal
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(10, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(10, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, 4, 5, kernel="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


# ------------------------------------------------------------------------------------------ worked examples


def test_bottom_right_causal_alignment_worked_example():
    # q = 0 makes every allowed score equal, so each output row is the mean of the values it may attend.
    v = torch.arange(1.0, 5.0, dtype=torch.float64).view(4, 1, 1)  # values 1, 2, 3, 4
    q = torch.zeros(2, 1, 1, dtype=torch.float64)
    k = torch.zeros(4, 1, 1, dtype=torch.float64)
    cu_q = torch.tensor([0, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 4], dtype=torch.int32)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, 2, 4, kernel="torch")
    # m=2 queries, n=4 keys: query 0 sees keys 0..2, query 1 sees keys 0..3 (not keys 0 and 0..1: top-left).
    assert out.flatten().tolist() == pytest.approx([2.0, 2.5])
    assert lse.flatten().tolist() == pytest.approx([torch.log(torch.tensor(3.0)).item(), torch.log(torch.tensor(4.0)).item()])


def test_fewer_keys_than_queries_leaves_leading_queries_empty_without_nan():
    # m=3 queries, n=1 key: queries 0 and 1 attend nothing (out 0, lse -inf); query 2 attends key 0.
    q = torch.zeros(3, 1, 2)
    k = torch.zeros(1, 1, 2)
    v = torch.tensor([[[5.0, -1.0]]])
    cu_q = torch.tensor([0, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 1], dtype=torch.int32)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, 3, 1, kernel="torch")
    assert out[:, 0].tolist() == [[0.0, 0.0], [0.0, 0.0], [5.0, -1.0]]
    assert lse[0, :2].tolist() == [float("-inf")] * 2 and lse[0, 2].item() == 0.0
    dq, dk, dv = varlen_attention_backward(torch.ones_like(out), q, k, v, out, lse, cu_q, cu_k, 3, 1, kernel="torch")
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert dv.flatten().tolist() == [1.0, 1.0]  # only query 2 reads v[0], with weight 1


def test_empty_inputs_and_all_empty_sequences():
    H, D = 2, 4
    # no tokens at all
    q, k = torch.zeros(0, H, D), torch.zeros(0, H, D)
    cu = torch.zeros(1, dtype=torch.int32)
    out, lse = varlen_attention_forward(q, k, k, cu, cu, 0, 0, kernel="torch")
    assert out.shape == (0, H, D) and lse.shape == (H, 0)
    # queries but every key sequence empty: zero output, -inf lse, zero finite grads
    q = torch.randn(5, H, D, requires_grad=True)
    k = torch.randn(0, H, D, requires_grad=True)
    v = torch.randn(0, H, D, requires_grad=True)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 0], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu_q, cu_k, 3, 0, kernel="torch")
    assert torch.equal(out, torch.zeros(5, H, D))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_gqa_equals_multi_head_attention_with_repeated_kv():
    q, k, v, dout, cu_q, cu_k, mq, mk = make_case([4, 6], [5, 6], 0, 0, H=6, H_kv=2, D=4, seed=3)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, mq, mk, kernel="torch")
    kr, vr = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    out_r, lse_r = varlen_attention_forward(q, kr, vr, cu_q, cu_k, mq, mk, kernel="torch")
    torch.testing.assert_close(out, out_r)
    torch.testing.assert_close(lse, lse_r)
    dq, dk, dv = varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, kernel="torch")
    dq_r, dk_r, dv_r = varlen_attention_backward(dout, q, kr, vr, out_r, lse_r, cu_q, cu_k, mq, mk, kernel="torch")
    torch.testing.assert_close(dq, dq_r)
    torch.testing.assert_close(dk, dk_r.view(-1, 2, 3, 4).sum(2))
    torch.testing.assert_close(dv, dv_r.view(-1, 2, 3, 4).sum(2))


def test_backward_uses_the_given_out_and_lse():
    # Splitting the keys of one sequence in two blocks and feeding each block the MERGED out/lse gives gradients
    # that add up to the full-attention ones (what ring attention relies on). Non-causal blocks, as in a ring step.
    q, k, v, dout, _, _, _, _ = make_case([6], [10], 0, 0, H=2, H_kv=1, D=4, seed=5)
    cu_q = torch.tensor([0, 6], dtype=torch.int32)
    full_cu_k = torch.tensor([0, 10], dtype=torch.int32)
    out, lse = varlen_attention_forward(q, k, v, cu_q, full_cu_k, 6, 10, causal=False, kernel="torch")
    dq, dk, dv = varlen_attention_backward(dout, q, k, v, out, lse, cu_q, full_cu_k, 6, 10, causal=False, kernel="torch")
    parts = []
    for lo, hi in ((0, 4), (4, 10)):
        cu_k = torch.tensor([0, hi - lo], dtype=torch.int32)
        parts.append(varlen_attention_backward(
            dout, q, k[lo:hi], v[lo:hi], out, lse, cu_q, cu_k, 6, hi - lo, causal=False, kernel="torch"
        ))
    torch.testing.assert_close(parts[0][0] + parts[1][0], dq)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), dk)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]]), dv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_compute_in_float32_and_return_input_dtype(dtype):
    q, k, v, dout, cu_q, cu_k, mq, mk = make_case([8, 16, 8], [8, 20, 8], 0, 0, H=4, H_kv=2, D=16, seed=7,
                                                  dtype=dtype)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, mq, mk, kernel="torch")
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse, rdq, rdk, rdv = dense_grads(q, k, v, dout, cu_q, cu_k, True)
    # the only errors are the rounding of the inputs (exact in float64) and of the outputs to the half dtype
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    dq, dk, dv = varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, kernel="torch")
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_large_batch_is_split_into_memory_bounded_groups(monkeypatch):
    monkeypatch.setattr(kernels, "_REFERENCE_SCORE_BUDGET", 64)  # forces groups of one or two sequences
    q, k, v, dout, cu_q, cu_k, mq, mk = make_case([3, 0, 5, 2, 4], [3, 1, 6, 2, 4], 1, 0, H=2, H_kv=1, D=3, seed=9)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, mq, mk, kernel="torch")
    ref_out, ref_lse, rdq, rdk, rdv = dense_grads(q, k, v, dout, cu_q, cu_k, True)
    torch.testing.assert_close(out, ref_out)
    dq, dk, dv = varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, kernel="torch")
    torch.testing.assert_close(dq, rdq)
    torch.testing.assert_close(dk, rdk)
    torch.testing.assert_close(dv, rdv)


# --------------------------------------------------------------------------------------- kernel selection


def test_kernel_selection_on_cpu_and_by_dtype(monkeypatch):
    assert available_kernels("cpu") == ("torch",)
    assert select_kernel("cpu", torch.bfloat16) == "torch"
    # on CUDA, fp16/bf16 go to flash-attn when it imports, then torch varlen; float32 always to the reference
    monkeypatch.setattr(kernels, "_flash_attn_interface", lambda: object())
    monkeypatch.setattr(kernels, "_torch_varlen_attn", lambda: object())
    assert select_kernel("cuda", torch.bfloat16) == "flash_attn"
    assert select_kernel("cuda", torch.float32) == "torch"
    monkeypatch.setattr(kernels, "_flash_attn_interface", lambda: None)
    assert select_kernel("cuda", torch.float16) == "torch_varlen"
    monkeypatch.setattr(kernels, "_torch_varlen_attn", lambda: None)
    assert select_kernel("cuda", torch.float16) == "torch"


def test_auto_kernel_on_cpu_is_the_reference(flash_stub):
    # even with a flash_attn importable, CPU tensors use the reference kernel
    q, k, v, _, cu_q, cu_k, mq, mk = make_case([3, 4], [3, 4], 0, 0, H=2, H_kv=2, D=4, seed=1)
    calls = []
    original = flash_stub._flash_attn_varlen_forward
    try:
        flash_stub._flash_attn_varlen_forward = lambda *a, **kw: calls.append(1) or original(*a, **kw)
        varlen_attention_forward(q, k, v, cu_q, cu_k, mq, mk)
    finally:
        flash_stub._flash_attn_varlen_forward = original
    assert calls == []


def test_missing_flash_attn_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    q = torch.zeros(2, 1, 8)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ImportError, match=r"cp-packing\[flash\]"):
        varlen_attention_forward(q, q, q, cu, cu, 2, 2, kernel="flash_attn")


def test_torch_varlen_kernel_refuses_cpu_tensors():
    q = torch.zeros(2, 1, 8)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="torch_varlen"):
        varlen_attention_forward(q, q, q, cu, cu, 2, 2, kernel="torch_varlen")


def test_attention_modules_import_no_optional_dependency_at_module_level():
    """flash_attn / ring_flash_attn / transformers may only be imported inside functions (a static check of the
    module-level statements, cheaper than a fresh interpreter)."""
    import ast

    import cp_packing.attention as pkg

    root = os.path.dirname(pkg.__file__)
    for name in ("__init__.py", "kernels.py", "ring.py"):
        with open(os.path.join(root, name)) as f:
            tree = ast.parse(f.read())
        for node in tree.body:  # module level only
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            for mod in mods:
                assert mod.split(".")[0] not in {"flash_attn", "ring_flash_attn", "transformers"}, (name, mod)


# ------------------------------------------------------------------------------------------------- errors


def _args(**over):
    q = torch.zeros(4, 2, 8)
    k = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    args = dict(q=q, k=k, v=k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(q=torch.zeros(1, 4, 2, 8)), ValueError, "3-D"),
        (dict(q=[[0.0]]), TypeError, "torch.Tensor"),
        (dict(q=torch.zeros(4, 3, 8)), ValueError, "multiple of the key/value heads"),
        (dict(q=torch.zeros(4, 2, 4)), ValueError, "head_dim"),
        (dict(q=torch.zeros(4, 2, 8, dtype=torch.float64)), TypeError, "one dtype"),
        (dict(q=torch.zeros(4, 2, 8, dtype=torch.int64)), TypeError, "floating-point"),
        (dict(cu_seqlens_q=torch.tensor([0.0, 4.0])), TypeError, "int32"),
        (dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError, "one key sequence"),
        (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32), max_seqlen_q=5), ValueError, "outside"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 1], dtype=torch.int32),
              cu_seqlens_k=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError, "non-decreasing"),
        (dict(max_seqlen_k=3), ValueError, "max_seqlen_k=3"),
        (dict(max_seqlen_q=4.0), TypeError, "max_seqlen_q"),
    ],
)
def test_bad_inputs_raise_clear_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        varlen_attention_forward(**_args(**over), kernel="torch")


def test_unknown_kernel_and_bad_grad_shapes():
    with pytest.raises(ValueError, match="unknown attention kernel 'triton'"):
        varlen_attention_forward(**_args(), kernel="triton")
    a = _args()
    out, lse = varlen_attention_forward(**a, kernel="torch")
    with pytest.raises(ValueError, match=r"lse must be \[H, Tq\]"):
        varlen_attention_backward(out, a["q"], a["k"], a["v"], out, lse.T, a["cu_seqlens_q"], a["cu_seqlens_k"], 4, 4)
    with pytest.raises(ValueError, match="dout must have q's shape"):
        varlen_attention_backward(out[:2], a["q"], a["k"], a["v"], out, lse, a["cu_seqlens_q"], a["cu_seqlens_k"], 4, 4)


# ------------------------------------------------------------------------------------ flash_attn stand-in


def test_stub_varlen_forward_matches_reference_with_flash_conventions(flash_stub):
    q, k, v, _, cu_q, cu_k, mq, mk = make_case([4, 2, 5], [6, 0, 5], 1, 0, H=4, H_kv=2, D=8, seed=11,
                                               dtype=torch.float32)
    outputs = flash_stub._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, 0.3, True)
    assert len(outputs) == 4
    out, lse, S_dmask, rng_state = outputs
    ref_out, ref_lse = varlen_attention_forward(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, kernel="torch")
    assert lse.dtype == torch.float32 and lse.shape == (4, q.shape[0])
    torch.testing.assert_close(out, ref_out)
    empty = torch.isneginf(ref_lse)
    assert empty.any() and torch.isposinf(lse[empty]).all(), "flash-attn writes +inf for a query without keys"
    torch.testing.assert_close(lse[~empty], ref_lse[~empty])
    assert S_dmask.numel() == 0 and rng_state.shape == (2,)


def test_stub_varlen_backward_writes_given_buffers_in_place(flash_stub):
    q, k, v, dout, cu_q, cu_k, mq, mk = make_case([4, 5], [6, 5], 0, 0, H=2, H_kv=1, D=8, seed=12,
                                                  dtype=torch.float32)
    out, lse, _, _ = flash_stub._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, True)
    # ring-flash-attn passes views of larger buffers (dq_buffer[:seqlen_q]) and reads the buffers afterwards
    dq_buf, dk_buf, dv_buf = torch.full((20, 2, 8), 7.0), torch.full((20, 1, 8), 7.0), torch.full((20, 1, 8), 7.0)
    ret = flash_stub._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq_buf[:9], dk_buf[:11], dv_buf[:11], cu_q, cu_k, mq, mk,
        0.0, None, True, -1, -1, 0.0, None, False,
    )
    rdq, rdk, rdv = varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, kernel="torch")
    torch.testing.assert_close(dq_buf[:9], rdq)
    torch.testing.assert_close(dk_buf[:11], rdk)
    torch.testing.assert_close(dv_buf[:11], rdv)
    assert (dq_buf[9:] == 7.0).all() and (dk_buf[11:] == 7.0).all(), "writes stay inside the given views"
    assert ret.shape == (2, 9)


def test_stub_batched_functions_match_varlen_reference(flash_stub):
    B, S, Sk, H, H_kv, D = 2, 5, 7, 4, 2, 8
    g = torch.Generator().manual_seed(13)
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, Sk, H_kv, D, generator=g)
    v = torch.randn(B, Sk, H_kv, D, generator=g)
    dout = torch.randn(B, S, H, D, generator=g)
    out, lse, _, _ = flash_stub._flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    assert out.shape == (B, S, H, D) and lse.shape == (B, H, S)
    cu_q = torch.tensor([0, S, 2 * S], dtype=torch.int32)
    cu_k = torch.tensor([0, Sk, 2 * Sk], dtype=torch.int32)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    r_out, r_lse = varlen_attention_forward(flat(q), flat(k), flat(v), cu_q, cu_k, S, Sk, softmax_scale=0.25)
    torch.testing.assert_close(flat(out), r_out)
    torch.testing.assert_close(lse.transpose(0, 1).reshape(H, -1), r_lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    flash_stub._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    rdq, rdk, rdv = varlen_attention_backward(
        flat(dout), flat(q), flat(k), flat(v), r_out, r_lse, cu_q, cu_k, S, Sk, softmax_scale=0.25
    )
    torch.testing.assert_close(flat(dq), rdq)
    torch.testing.assert_close(flat(dk), rdk)
    torch.testing.assert_close(flat(dv), rdv)


def test_stub_refuses_what_it_does_not_compute(flash_stub):
    q = torch.zeros(4, 1, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_stub._flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.1, None, True)
    with pytest.raises(NotImplementedError, match="window_size"):
        flash_stub._flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.0, None, True, window_size_left=2)
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_stub._flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.0, None, True, softcap=30.0)


@pytest.mark.parametrize("D", [8, 5])
def test_flash_attn_kernel_path_against_the_stub(flash_stub, D):
    """Runs cp-packing's flash-attn calling code (keyword names, +inf/-inf lse translation, head_dim padding to a
    multiple of 8) against the 2.8-signature stand-in: same results as the reference kernel."""
    q, k, v, dout, cu_q, cu_k, mq, mk = make_case([4, 3, 5], [6, 1, 5], 0, 0, H=4, H_kv=2, D=D, seed=14,
                                                  dtype=torch.float32)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, mq, mk, kernel="flash_attn")
    r_out, r_lse = varlen_attention_forward(q, k, v, cu_q, cu_k, mq, mk, kernel="torch")
    torch.testing.assert_close(out, r_out)
    torch.testing.assert_close(lse, r_lse)  # -inf on the empty rows, like the reference
    grads = varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, kernel="flash_attn")
    r_grads = varlen_attention_backward(dout, q, k, v, r_out, r_lse, cu_q, cu_k, mq, mk, kernel="torch")
    for got, want in zip(grads, r_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


def test_failed_flash_attn_import_is_not_retried_in_every_layer(monkeypatch):
    """kernel="auto" asks for flash-attn in every attention layer: a failed import is remembered (per sys.path)."""
    import importlib
    import sys

    from cp_packing import _imports
    from cp_packing.attention import kernels as K

    calls = []

    def failing_import(name, *args, **kwargs):
        calls.append(name)
        raise ImportError(name)

    monkeypatch.setattr(_imports, "_FAILED", set())
    monkeypatch.delitem(sys.modules, "flash_attn.flash_attn_interface", raising=False)
    monkeypatch.setattr(importlib, "import_module", failing_import)
    assert K._flash_attn_interface() is None and K._flash_attn_interface() is None
    assert calls == ["flash_attn.flash_attn_interface"]
    monkeypatch.setattr(sys, "path", sys.path + ["/a/new/place"])  # a stand-in put on sys.path later is looked for
    assert K._flash_attn_interface() is None and len(calls) == 2
