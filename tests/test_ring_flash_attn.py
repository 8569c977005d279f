"""The REAL ring-flash-attn 0.1.8 varlen kernels, fed with cp-packing shards, against full attention.

ring-flash-attn runs here on CPU + gloo on top of the pure-torch flash_attn stand-in in ``tests/flash_attn_stub``
(flash-attn 2.8 signatures, delegating to cp-packing's reference kernel). Each rank gets ``sharded.shard(q/k/v)``
and ``ring_flash_attn_kwargs(sharded)``; the result must equal causal attention per segment on the global stream
(the reference kernel in float64), forward and backward (the full-attention gradients, sharded).
"""

from __future__ import annotations

import sys

import pytest
import torch

from cp_packing.adapters import ring_flash_attn_kwargs
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from tests.conftest import use_flash_attn_stub
from cp_packing.testing import run_distributed, synthetic_doc_ids

pytestmark = pytest.mark.distributed

H, H_KV, D = 4, 2, 8


# ----------------------------------------------------------------------------------------------------- maps


def zigzag_doc_map(B: int, S: int, unit: int, seed: int) -> torch.Tensor:
    """Seeded ``[B, S]`` map whose every run (padding too) is a multiple of ``unit`` = 2*cp long."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        pos, doc = 0, 1
        while pos < S:
            length = min(S - pos, unit * int(torch.randint(1, 4, (), generator=g)))
            is_pad = pos > 0 and bool(torch.rand((), generator=g) < 0.2) and out[b, pos - 1] != 0
            out[b, pos : pos + length] = 0 if is_pad else doc
            doc += 0 if is_pad else 1
            pos += length
    return out


# --------------------------------------------------------------------------------------------- rank bodies


def _inputs(T: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(T, h, D, generator=g, dtype=torch.float64).to(dtype) for h in (H, H_KV, H_KV, H)
    )
    return q, k, v, dout


def _full_attention(params, q, k, v, dout):
    """Causal attention per segment on the whole global stream (float64 reference kernel) and its gradients."""
    from cp_packing.attention.kernels import varlen_attention

    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    cu, m = params.cu_seqlens, params.max_seqlen
    out = varlen_attention(q64, k64, v64, cu, cu, m, m, causal=True, kernel="torch")
    out.backward(dout.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))


def _ring_rank(rank, world_size, doc_ids, layout, dtype, seed, api, heads_k_stride):
    use_flash_attn_stub()
    from cp_packing.attention.dispatch import ring_attention
    from cp_packing.attention.ring import import_ring_flash_attn
    from cp_packing.adapters import ring_flash_attn_kwargs
    from cp_packing.sharding import shard_packed_seq_params

    rfa = import_ring_flash_attn()
    params = packed_seq_params_from_doc_ids(doc_ids)
    sharded = shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout=layout)
    q, k, v, dout = _inputs(params.total_tokens, seed, dtype)
    ref = _full_attention(params, q, k, v, dout)

    ql, kl, vl = (sharded.shard(x).requires_grad_() for x in (q, k, v))
    if api == "wrapper":
        out = ring_attention(ql, kl, vl, sharded, group=None, heads_k_stride=heads_k_stride)
    elif layout == "zigzag":
        out = rfa.zigzag_ring_flash_attn_varlen_func(ql, kl, vl, causal=True, group=None,
                                                     **ring_flash_attn_kwargs(sharded))
    else:
        out = rfa.llama3_flash_attn_varlen_func(ql, kl, vl, heads_k_stride=heads_k_stride, causal=True, group=None,
                                                **ring_flash_attn_kwargs(sharded))
    out.backward(sharded.shard(dout))
    assert out.dtype == dtype and ql.grad.dtype == dtype
    got = (out, ql.grad, kl.grad, vl.grad)
    return {name: _rel_err(g, sharded.shard(r)) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}


def _run(doc_ids, cp, layout, dtype, seed=0, api="direct", heads_k_stride=H_KV):
    errors = run_distributed(_ring_rank, cp, doc_ids, layout, dtype, seed, api, heads_k_stride)
    return {name: max(e[name] for e in errors) for name in errors[0]}


# bf16 inputs are exact in the float64 reference; what is left is bf16 rounding of every block output and
# gradient (relative 2**-8 ~ 4e-3 each), accumulated over a few ring steps (measured: at most 9e-3 here). A wrong
# layout or metadata gives errors of order 1.
BF16_TOL = {"out": 1.5e-2, "dq": 2.5e-2, "dk": 2.5e-2, "dv": 2.5e-2}
FP32_TOL = 1e-5


# ---------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("cp, seed", [(2, 0), (2, 1), (4, 2)])
def test_zigzag_ring_varlen_bf16_matches_full_attention(ring_flash_attn, cp, seed):
    doc_ids = zigzag_doc_map(2, 32, 2 * cp, seed)  # T = 64, T_local = 64 / cp
    errors = _run(doc_ids, cp, "zigzag", torch.bfloat16, seed)
    for name, err in errors.items():
        assert err < BF16_TOL[name], (name, err, doc_ids.tolist())


def reaches_back(doc_ids: torch.Tensor, cp: int) -> bool:
    """Some rank's first segment started on an earlier rank, so its keys reach back (seqlen_k > seqlen_q)."""
    from cp_packing.sharding import shard_packed_seq_params

    params = packed_seq_params_from_doc_ids(doc_ids)
    T_local = params.total_tokens // cp
    shards = (shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout="contiguous") for r in range(cp))
    return any(ring_flash_attn_kwargs(s)["local_k_slice"].start < s.cp_rank * T_local for s in shards)


@pytest.mark.parametrize("cp, seed", [(2, 0), (2, 1), (4, 2)])
def test_llama3_varlen_float32_matches_full_attention(ring_flash_attn, cp, seed):
    # arbitrary segments, shard edges inside the row
    doc_ids = synthetic_doc_ids("lognormal", 1, 48, seed=seed, median=10, pad=0.1)
    assert reaches_back(doc_ids, cp), "the map must test keys that start on an earlier rank"
    # heads_k_stride=1: one all-gather per key/value head (the loop over head groups in llama3's kernel)
    errors = _run(doc_ids, cp, "contiguous", torch.float32, seed, heads_k_stride=1)
    for name, err in errors.items():
        assert err < FP32_TOL, (name, err, doc_ids.tolist())


@pytest.mark.parametrize("layout, dtype", [("zigzag", torch.bfloat16), ("contiguous", torch.float32)])
def test_ring_attention_routes_each_layout_to_its_kernel(ring_flash_attn, layout, dtype):
    cp = 2
    doc_ids = (zigzag_doc_map(2, 16, 2 * cp, 5) if layout == "zigzag"
               else synthetic_doc_ids("lognormal", 1, 32, seed=5, median=10, pad=0.1))
    assert layout == "zigzag" or reaches_back(doc_ids, cp)
    errors = _run(doc_ids, cp, layout, dtype, seed=5, api="wrapper", heads_k_stride=None)
    tol = BF16_TOL if dtype == torch.bfloat16 else dict.fromkeys(errors, FP32_TOL)
    for name, err in errors.items():
        assert err < tol[name], (name, err)


def test_upstream_zigzag_float32_backward_is_still_wrong(ring_flash_attn):
    """Documents the upstream bug that makes ring_attention refuse float32 zigzag: forward right, backward wrong
    (``dq = dq_buffer.to(torch.float32)`` aliases the kernel's buffer in float32). If this test fails, upstream
    has fixed it: drop the refusal in cp_packing.attention.ring."""
    doc_ids = zigzag_doc_map(2, 16, 4, 3)
    errors = _run(doc_ids, 2, "zigzag", torch.float32, seed=3)
    assert errors["out"] < FP32_TOL
    assert max(errors["dq"], errors["dk"], errors["dv"]) > 1e-2, errors


def _wrong_group_rank(rank, world_size):
    use_flash_attn_stub()
    from cp_packing.attention.dispatch import ring_attention
    from cp_packing.sharding import shard_packed_seq_params

    params = packed_seq_params_from_doc_ids(torch.ones(1, 8, dtype=torch.int64))
    sharded = shard_packed_seq_params(params, cp_size=world_size, cp_rank=world_size - 1 - rank, layout="zigzag")
    q = torch.zeros(sharded.num_local_tokens, 2, 8, dtype=torch.bfloat16)
    try:
        ring_attention(q, q, q, sharded, group=None)
    except ValueError as e:
        return str(e)
    return None


def test_ring_attention_rejects_a_group_that_does_not_match_the_shard(ring_flash_attn):
    messages = run_distributed(_wrong_group_rank, 2)
    assert all(m is not None and "cp_rank" in m for m in messages), messages


# ------------------------------------------------------------------------------------ no communication needed


def _zigzag_shard(cp=2, rank=0):
    from cp_packing.sharding import shard_packed_seq_params

    return shard_packed_seq_params(packed_seq_params_from_doc_ids(torch.ones(1, 8, dtype=torch.int64)),
                                   cp_size=cp, cp_rank=rank, layout="zigzag")


def test_ring_attention_refuses_float32_zigzag_with_the_reason():
    from cp_packing.attention.dispatch import ring_attention

    sharded = _zigzag_shard()
    q = torch.zeros(4, 2, 8)
    with pytest.raises(TypeError, match=r"float32.*(bfloat16|float16)"):
        ring_attention(q, q, q, sharded, group=None)


def test_ring_attention_rejects_bad_shapes_and_layouts():
    from cp_packing.attention.dispatch import ring_attention
    from cp_packing.sharding import shard_packed_seq_params

    sharded = _zigzag_shard()
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="T_local=4"):
        ring_attention(torch.zeros(8, 2, 8, dtype=torch.bfloat16), q, q, sharded, group=None)
    with pytest.raises(ValueError, match=r"\[T_local, heads, head_dim\]"):
        ring_attention(q[None], q, q, sharded, group=None)
    with pytest.raises(TypeError, match="ShardedPackedSeqParams"):
        ring_attention(q, q, q, sharded.global_params, group=None)
    params = packed_seq_params_from_doc_ids(torch.ones(1, 8, dtype=torch.int64))
    balanced = shard_packed_seq_params(params, cp_size=2, cp_rank=0, layout="balanced")
    with pytest.raises(ValueError, match="no kernel for layout 'balanced'"):
        ring_attention(q, q, q, balanced, group=None)


def test_import_errors_name_what_to_install(monkeypatch):
    from cp_packing.attention.ring import import_ring_flash_attn

    monkeypatch.delitem(sys.modules, "ring_flash_attn", raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(ImportError, match=r"cp-packing\[flash\]"):
        import_ring_flash_attn()
    monkeypatch.setitem(sys.modules, "ring_flash_attn", None)
    with pytest.raises(ImportError, match=r"cp-packing\[ring\]"):
        import_ring_flash_attn()


def test_import_works_around_transformers_5_4_and_stub_signatures_fit(ring_flash_attn):
    import transformers.modeling_flash_attention_utils as fa_utils

    # the whole package imported, HF adapter included, thanks to the restored flag
    assert hasattr(ring_flash_attn, "substitute_hf_flash_attn")
    assert hasattr(fa_utils, "is_flash_attn_greater_or_equal_2_10")
    # ring-flash-attn builds its kernel kwargs from the stub's signature: it must take the flash-attn >= 2.7 path
    import flash_attn.flash_attn_interface as fai

    from ring_flash_attn.utils import get_default_args

    for fn in (fai._flash_attn_varlen_forward, fai._flash_attn_varlen_backward, fai._flash_attn_forward,
               fai._flash_attn_backward):
        args = get_default_args(fn)
        assert "window_size_left" in args and "window_size" not in args and args["softcap"] == 0.0


def _contiguous_shard(cp=2, rank=0):
    from cp_packing.sharding import shard_packed_seq_params

    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]])
    return shard_packed_seq_params(packed_seq_params_from_doc_ids(doc_ids), cp_size=cp, cp_rank=rank,
                                   layout="contiguous")


@pytest.fixture
def spy_ring(monkeypatch):
    """ring_attention up to the kernel call, without ring-flash-attn or a process group: the kernels are spies that
    record their kwargs; ``set_flash_attn(stub=...)`` installs a fake ``flash_attn`` (the real one or the stand-in)."""
    import types

    import cp_packing.attention.plan as plan
    import cp_packing.attention.ring as ring

    calls = []

    def kernel(name):
        def fn(q, k, v, **kwargs):
            calls.append((name, q, kwargs))
            return q.new_zeros(q.shape)
        return fn

    fake = types.SimpleNamespace(zigzag_ring_flash_attn_varlen_func=kernel("zigzag"),
                                 llama3_flash_attn_varlen_func=kernel("llama3"))
    monkeypatch.setattr(ring, "import_ring_flash_attn", lambda: fake)
    monkeypatch.setattr(plan, "resolve_attention_group", lambda group, sharded, device: group)

    def set_flash_attn(stub: bool):
        module = types.ModuleType("flash_attn")
        if stub:
            module.IS_CP_PACKING_STUB = True
        monkeypatch.setitem(sys.modules, "flash_attn", module)

    set_flash_attn(stub=False)
    return types.SimpleNamespace(calls=calls, set_flash_attn=set_flash_attn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ring_attention_refuses_non_half_dtypes_with_real_flash_attn(spy_ring, dtype):
    """flash-attn's CUDA kernels run fp16/bf16 only: with the real package, float32 contiguous is refused up front
    with the fix (not a crash inside flash-attn); the test stand-in runs it."""
    from cp_packing.attention.dispatch import ring_attention

    sharded = _contiguous_shard()
    q = torch.zeros(sharded.num_local_tokens, 2, 8, dtype=dtype)
    with pytest.raises(TypeError, match=r"float16 / torch\.bfloat16 only.*allgather"):
        ring_attention(q, q, q, sharded, group=None)
    assert spy_ring.calls == []
    ring_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), sharded, group=None)  # half: runs
    spy_ring.set_flash_attn(stub=True)
    ring_attention(q, q, q, sharded, group=None)
    assert [c[0] for c in spy_ring.calls] == ["llama3", "llama3"]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_attention_moves_the_metadata_to_q_device(spy_ring, layout):
    """The shard's cu_seqlens live on the CPU; the step plan's ring kwargs are on q's device (here "meta", a device
    that is not the CPU and needs no GPU), built once per step, and the kernel gets them."""
    from cp_packing.attention import ring
    from cp_packing.attention.dispatch import ring_attention

    sharded = _zigzag_shard() if layout == "zigzag" else _contiguous_shard()
    q = torch.zeros(sharded.num_local_tokens, 2, 8, dtype=torch.bfloat16)
    ring_attention(q, q, q, sharded, group=None)
    (_, _, kwargs), = spy_ring.calls
    assert all(v.device == q.device for v in kwargs.values() if isinstance(v, torch.Tensor))
    from cp_packing.attention.plan import TableContext
    from cp_packing.options import AttentionOptions

    kwargs = ring.build_tables(TableContext(sharded, AttentionOptions(), torch.device("meta")), True, None)["kwargs"]
    tensors = {name: value for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
    assert {"cu_seqlens"} <= set(tensors) if layout == "zigzag" else {"cu_seqlens_q", "cu_seqlens_k"} <= set(tensors)
    assert all(value.device.type == "meta" for value in tensors.values()), {n: v.device for n, v in tensors.items()}
    assert all(value.dtype == torch.int32 for value in tensors.values())
