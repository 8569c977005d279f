"""Context-parallel attention (``context_parallel_attention``) equals full causal attention per segment.

The reference is dense masked attention on the GLOBAL stream (``tests/reference.py``, plain torch, independent of
the varlen kernels): token i attends token j iff both lie in the same segment and ``j <= i`` (or any j of the
segment when ``causal=False``). Every rank builds the same seeded global q/k/v/dout, computes the reference and its
gradients with autograd, shards them, and compares with its CP output and the gradients that flowed back through
the all-gather / reduce-scatter.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from cp_packing.attention.plan import prepare_attention

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.adapters import ring_flash_attn_kwargs
from cp_packing.testing import run_distributed, synthetic_doc_ids
from tests.reference import dense_attention

D = 8


def seeded_qkv(T, H, H_kv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, H_kv, D, generator=g)
    v = torch.randn(T, H_kv, D, generator=g)
    dout = torch.randn(T, H, D, generator=g)
    return [x.to(dtype) for x in (q, k, v, dout)]


def unit_map(B, S, unit, seed):
    """Seeded ``[B, S]`` doc map whose runs (padding too) all have lengths that are multiples of ``unit``."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        row, doc = [], 1
        while len(row) < S:
            n = unit * int(torch.randint(1, 4, (), generator=g))
            value = 0 if torch.rand((), generator=g) < 0.2 and (not row or row[-1] != 0) else doc
            if value:
                doc += 1
            row += [value] * min(n, S - len(row))
        rows.append(row)
    return torch.tensor(rows)


def _device() -> torch.device:
    """CPU, except under torchrun with NCCL (cp_packing.testing.run_distributed): this rank's GPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compare(doc_ids, layout, cp_size, cp_rank, *, H=4, H_kv=2, dtype=torch.float32, seed=0, causal=True,
            backend="allgather", kernel="auto", group=None, **options):
    """Max abs errors of this rank's CP out / dq / dk / dv against the sharded dense reference."""
    from cp_packing.attention.dispatch import context_parallel_attention

    params = packed_seq_params_from_doc_ids(doc_ids)
    sharded = shard_packed_seq_params(params, cp_size=cp_size, cp_rank=cp_rank, layout=layout)
    T = doc_ids.numel()
    q, k, v, dout = seeded_qkv(T, H, H_kv, dtype, seed)
    ref_in = [x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v)]
    ref = dense_attention(*ref_in, params.cu_seqlens, causal=causal)
    # (out * dout).sum().backward() rather than out.backward(dout): the latter imports sympy (2 s) on first use
    (ref * dout.double()).sum().backward()

    device = _device()
    local = [sharded.shard(x).to(device).detach().requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*local, sharded, group=group, causal=causal, backend=backend, kernel=kernel,
                                     **options)
    (out * sharded.shard(dout).to(device)).sum().backward()
    pairs = [(out.cpu(), ref)] + [(x.grad.cpu(), r.grad) for x, r in zip(local, ref_in)]
    names = ("out", "dq", "dk", "dv")
    errs = {}
    for name, (got, want) in zip(names, pairs):
        assert got.shape == sharded.shard(want).shape, (name, got.shape)
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        diff = got.detach().double() - sharded.shard(want.detach())
        errs[name] = float(diff.abs().max()) if diff.numel() else 0.0
    return errs


def _cases(cp_size):
    """(name, doc map, layout) cases for one CP size (T <= 96): shard-crossing documents, padding ranks."""
    m = 2 * cp_size
    S = 12 * cp_size if cp_size < 4 else 24
    return [
        ("contiguous random", synthetic_doc_ids("lognormal", 2, S, seed=cp_size, median=8, pad=0.1), "contiguous"),
        # one document spans every shard edge of its row
        ("contiguous long doc", torch.tensor([[1] * (8 * cp_size - 3) + [2] * 3, [0] * 2 + [1] * (8 * cp_size - 2)]),
         "contiguous"),
        # the last rank(s) hold nothing but padding
        ("contiguous padding rank", torch.tensor([[1] * 5 + [2] * 3 + [0] * (8 * cp_size - 8)]), "contiguous"),
        ("zigzag", unit_map(2, m * (48 // m // 2), m, seed=cp_size), "zigzag"),
        ("zigzag one doc", torch.tensor([[1] * (4 * m)]), "zigzag"),
        # long segments: runs of up to 16 queries against up to 64 keys
        ("zigzag long segments", torch.tensor([[1] * (64 // m * m) + [2] * ((96 - 64 // m * m) // m * m)]), "zigzag"),
        # every rank holds only padding: it still joins every collective, and padding attends padding
        ("zigzag all padding", torch.zeros(1, 2 * m, dtype=torch.int64), "zigzag"),
    ]


def _dist_allgather(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    errs = {name: compare(doc_ids, layout, world_size, rank, seed=i)
            for i, (name, doc_ids, layout) in enumerate(_cases(world_size))}
    # the group may be given as a 1-D DeviceMesh (the CP dimension of a DP x CP mesh), as everywhere else
    mesh = init_device_mesh(_device().type, (world_size,), mesh_dim_names=("cp",))
    name, doc_ids, _ = _cases(world_size)[3]
    errs["zigzag via a DeviceMesh group"] = compare(doc_ids, "zigzag", world_size, rank, group=mesh["cp"])
    return errs


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_allgather_matches_full_attention(cp_size):
    """Forward and backward (dq, dk, dv) equal full causal attention per segment: contiguous and zigzag layouts,
    GQA (H=4, H_kv=2), float32, documents across shard edges, all-padding ranks."""
    per_rank = run_distributed(_dist_allgather, cp_size)
    for rank, errs in enumerate(per_rank):
        assert set(errs) == {name for name, _, _ in _cases(cp_size)} | {"zigzag via a DeviceMesh group"}
        for name, e in errs.items():
            assert max(e.values()) < 2e-5, f"cp={cp_size} rank {rank} {name}: {e}"


def _dist_balanced(rank, world_size):
    return [compare(synthetic_doc_ids("lognormal", 2, 24, seed=seed, median=mean, pad=0.1), "balanced", world_size,
                    rank, seed=seed)
            for seed, mean in ((0, 6.0), (1, 20.0))]


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_allgather_balanced_layout(cp_size):
    try:
        import cp_packing.layouts.balanced  # noqa: F401
    except ImportError:
        pytest.skip("layout 'balanced' needs cp_packing/layouts/balanced.py, which is not in this tree yet")
    for rank, errs in enumerate(run_distributed(_dist_balanced, cp_size)):
        for e in errs:
            assert max(e.values()) < 2e-5, f"cp={cp_size} rank {rank}: {e}"


def test_the_checks_can_fail():
    """The comparison detects a cross-document leak: a reference without the segment mask differs."""
    doc_ids = torch.tensor([[1] * 6 + [2] * 6])
    params = packed_seq_params_from_doc_ids(doc_ids)
    q, k, v, _ = seeded_qkv(12, 4, 2, torch.float64, 0)
    masked = dense_attention(q, k, v, params.cu_seqlens)
    leaky = dense_attention(q, k, v, torch.tensor([0, 12], dtype=torch.int32))
    assert (masked - leaky)[6:].abs().max() > 1e-2
    assert torch.equal(masked[:6], leaky[:6])


# ------------------------------------------------------------------------------------------------ cp_size == 1


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
def test_cp1_needs_no_process_group(layout, causal):
    import torch.distributed as dist

    was_initialized = dist.is_initialized()  # True only under torchrun (cp_packing.testing.run_distributed)
    doc_ids = unit_map(2, 24, 2, seed=3)
    errs = compare(doc_ids, layout, 1, 0, causal=causal)
    assert max(errs.values()) < 2e-5, errs
    assert dist.is_initialized() == was_initialized


def test_cp1_float64_and_mha():
    errs = compare(synthetic_doc_ids("lognormal", 2, 20, seed=1, median=8, pad=0.1), "contiguous", 1, 0, H=2, H_kv=2,
                   dtype=torch.float64)
    assert max(errs.values()) < 1e-10, errs


# --------------------------------------------------------------------------------------------- causal=False, cp>1


def _dist_noncausal(rank, world_size):
    return {
        "contiguous": compare(synthetic_doc_ids("lognormal", 2, 24, seed=5, median=8, pad=0.1), "contiguous",
                              world_size, rank, causal=False),
        "zigzag": compare(unit_map(2, 24, 2 * world_size, seed=5), "zigzag", world_size, rank, causal=False),
    }


@pytest.mark.distributed
def test_allgather_non_causal_attends_the_whole_segment():
    for rank, errs in enumerate(run_distributed(_dist_noncausal, 2)):
        for name, e in errs.items():
            assert max(e.values()) < 2e-5, f"rank {rank} {name}: {e}"


# --------------------------------------------------------------------------------------------------- key index


def test_key_index_contiguous_is_a_view_of_the_gathered_buffer():
    from cp_packing.attention.allgather import allgather_keys

    doc_ids = synthetic_doc_ids("lognormal", 2, 24, seed=7, median=8, pad=0.1)
    params = packed_seq_params_from_doc_ids(doc_ids)
    for rank in range(3):
        sharded = shard_packed_seq_params(params, cp_size=3, cp_rank=rank, layout="contiguous")
        keys = allgather_keys(sharded)
        llama3 = ring_flash_attn_kwargs(sharded)
        assert keys.key_index is None and keys.key_slice == llama3["local_k_slice"]
        assert torch.equal(keys.cu_seqlens_k, llama3["cu_seqlens_k"])
        assert keys.max_seqlen_k == llama3["max_seqlen_k"]
        gathered = torch.randn(48, 2, D)
        assert keys.select(gathered).data_ptr() == gathered[llama3["local_k_slice"]].data_ptr()


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_key_index_zigzag_reaches_back_to_the_segment_start(cp_size):
    """Run i's keys are the global tokens from its segment start to its last token: (1 + 1/2cp) * T_segment keys in
    total on every rank but the last, whose two chunks of a segment touch (one run): (1/2 + 1/2cp) * T."""
    from cp_packing.attention.allgather import allgather_keys

    m = 2 * cp_size
    doc_ids = unit_map(3, 4 * m, m, seed=cp_size)
    params = packed_seq_params_from_doc_ids(doc_ids)
    T = doc_ids.numel()
    for rank in range(cp_size):
        sharded = shard_packed_seq_params(params, cp_size=cp_size, cp_rank=rank, layout="zigzag")
        keys = allgather_keys(sharded)
        last_rank = rank == cp_size - 1
        assert keys.num_keys * 2 * cp_size == T * ((cp_size + 1) if last_rank else (2 * cp_size + 1))
        order = sharded.global_token_order().reshape(-1)  # gathered row -> global position
        key_rows = keys.key_index if keys.key_index is not None else torch.arange(T)[keys.key_slice]
        global_keys = order[key_rows]
        run_cu = sharded.cu_seqlens.tolist()
        cu_k = keys.cu_seqlens_k.tolist()
        for i, start in enumerate(sharded.key_start.tolist()):
            last = int(sharded.token_index[run_cu[i + 1] - 1])
            assert global_keys[cu_k[i] : cu_k[i + 1]].tolist() == list(range(start, last + 1))


# ------------------------------------------------------------------------------------------------------ errors


def _small_shard(cp_size=1, cp_rank=0, layout="contiguous"):
    params = packed_seq_params_from_doc_ids(torch.tensor([[1] * 8 + [2] * 8]))
    return shard_packed_seq_params(params, cp_size=cp_size, cp_rank=cp_rank, layout=layout)


def test_bad_inputs_raise_clear_errors():
    from cp_packing.attention.dispatch import context_parallel_attention

    s = _small_shard()
    q, k, v = torch.randn(16, 4, D), torch.randn(16, 2, D), torch.randn(16, 2, D)
    with pytest.raises(ValueError, match="T_local=16"):
        context_parallel_attention(q[:15], k, v, s)
    with pytest.raises(ValueError, match="3-D"):
        context_parallel_attention(q[None], k, v, s)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        context_parallel_attention(torch.randn(16, 3, D), k, v, s)
    with pytest.raises(ValueError, match="same shape"):
        context_parallel_attention(q, k, v[:, :1], s)
    with pytest.raises(TypeError, match="one dtype"):
        context_parallel_attention(q, k.double(), v, s)
    with pytest.raises(TypeError, match="ShardedPackedSeqParams"):
        context_parallel_attention(q, k, v, s.global_params)
    with pytest.raises(ValueError, match="unknown attention backend 'ring'.*'allgather'"):
        context_parallel_attention(q, k, v, s, backend="ring")
    with pytest.raises(ValueError, match="unknown attention kernel"):
        context_parallel_attention(q, k, v, s, kernel="fast")
    with pytest.raises(TypeError, match="causal"):
        context_parallel_attention(q, k, v, s, causal=None)
    with pytest.raises(NotImplementedError, match="allgather"):
        context_parallel_attention(q, k, v, s, backend="ring_flash_attn", causal=False)


def test_cp_size_without_process_group_raises():
    import torch.distributed as dist

    from cp_packing.attention.dispatch import context_parallel_attention

    if dist.is_initialized():
        pytest.skip("a process group is initialised (torchrun)")
    s = _small_shard(cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="init_process_group"):
        context_parallel_attention(torch.randn(8, 2, D), torch.randn(8, 2, D), torch.randn(8, 2, D), s)


def _dist_wrong_group(rank, world_size):
    from cp_packing.attention.dispatch import context_parallel_attention

    messages = []
    for cp_size, cp_rank in ((4, rank), (2, 1 - rank)):
        s = _small_shard(cp_size=cp_size, cp_rank=cp_rank)
        x = torch.randn(16 // cp_size, 2, D)
        try:
            context_parallel_attention(x, x, x, s, backend="allgather")
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.mark.distributed
def test_group_that_does_not_match_the_shard_raises():
    for messages in run_distributed(_dist_wrong_group, 2):
        assert len(messages) == 2
        assert "cp_size=4" in messages[0] and "2 ranks" in messages[0]
        assert "cp_rank" in messages[1]


def test_auto_never_routes_float32_or_other_layouts_to_ring():
    from cp_packing.attention.plan import _auto_wants_ring

    assert _auto_wants_ring("cuda", torch.bfloat16, "zigzag", 2, True, "auto")
    assert _auto_wants_ring("cuda", torch.float16, "contiguous", 8, True, "flash_attn")
    assert not _auto_wants_ring("cuda", torch.float32, "zigzag", 2, True, "auto")
    assert not _auto_wants_ring("cuda", torch.bfloat16, "balanced", 2, True, "auto")
    assert not _auto_wants_ring("cuda", torch.bfloat16, "zigzag", 2, False, "auto")
    assert not _auto_wants_ring("cuda", torch.bfloat16, "zigzag", 1, True, "auto")
    assert not _auto_wants_ring("cuda", torch.bfloat16, "zigzag", 2, True, "torch")
    assert not _auto_wants_ring("cpu", torch.bfloat16, "zigzag", 2, True, "auto")


def test_auto_logs_its_choice_once(caplog):
    from cp_packing.attention import dispatch, plan

    plan._LOGGED.clear()
    s = _small_shard()
    q = torch.randn(16, 2, D)
    with caplog.at_level(logging.INFO, logger="cp_packing"):
        for _ in range(3):
            dispatch.context_parallel_attention(q, q, q, s)
    lines = [r.getMessage() for r in caplog.records if "context_parallel_attention" in r.getMessage()]
    assert len(lines) == 1 and "backend=allgather kernel=torch" in lines[0]


# ------------------------------------------------------------------------------------------- ring via stand-in


def _dist_ring(rank, world_size):
    from tests.conftest import use_flash_attn_stub

    use_flash_attn_stub()
    from cp_packing.attention.dispatch import select_backend

    m = 2 * world_size
    out = {
        "zigzag bf16": compare(unit_map(2, 4 * m, m, seed=2), "zigzag", world_size, rank, dtype=torch.bfloat16,
                               backend="ring_flash_attn"),
        "contiguous bf16": compare(synthetic_doc_ids("lognormal", 2, 24, seed=2, median=8, pad=0.1), "contiguous",
                                   world_size, rank,
                                   dtype=torch.bfloat16, backend="ring_flash_attn"),
        "contiguous fp32": compare(synthetic_doc_ids("lognormal", 2, 24, seed=4, median=8, pad=0.1), "contiguous",
                                   world_size, rank,
                                   backend="ring_flash_attn"),
    }
    # auto on CPU keeps to the built-in backend even though ring-flash-attn imports here
    s = shard_packed_seq_params(packed_seq_params_from_doc_ids(unit_map(1, m * 2, m, 0)), cp_size=world_size,
                                cp_rank=rank, layout="zigzag")
    out["auto"] = select_backend(torch.zeros(s.num_local_tokens, 2, D, dtype=torch.bfloat16), s)
    try:
        compare(unit_map(2, 4 * m, m, seed=2), "zigzag", world_size, rank, backend="ring_flash_attn")
        out["fp32 zigzag"] = "accepted"
    except TypeError as e:
        out["fp32 zigzag"] = str(e)
    return out


@pytest.mark.distributed
def test_ring_backend_through_the_stand_in(ring_flash_attn):
    for rank, res in enumerate(run_distributed(_dist_ring, 2)):
        for name in ("zigzag bf16", "contiguous bf16"):
            e = res[name]
            assert e["out"] < 3e-2 and max(e["dq"], e["dk"], e["dv"]) < 6e-2, f"rank {rank} {name}: {e}"
        assert max(res["contiguous fp32"].values()) < 2e-5, res["contiguous fp32"]
        assert res["auto"] == ("allgather", "torch")
        assert "float32" in res["fp32 zigzag"]


def _dist_allgather_bf16(rank, world_size):
    return compare(unit_map(2, 16, 4, seed=9), "zigzag", world_size, rank, dtype=torch.bfloat16)


@pytest.mark.distributed
def test_allgather_bf16():
    for rank, e in enumerate(run_distributed(_dist_allgather_bf16, 2)):
        assert e["out"] < 3e-2 and max(e["dq"], e["dk"], e["dv"]) < 6e-2, f"rank {rank}: {e}"


def test_device_backend_parses_mixed_backend_configs():
    """Which backend a group uses for a device's tensors, from dist.get_backend_config's string."""
    from cp_packing.groups import backend_for_device as _device_backend

    assert _device_backend("cpu:gloo,cuda:nccl", "cpu") == "gloo"  # init_process_group() on a GPU machine
    assert _device_backend("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert _device_backend("cuda:nccl", "cpu") == ""  # init_process_group("nccl"): no backend for CPU tensors
    assert _device_backend("nccl", "cpu") == "" and _device_backend("nccl", "cuda") == "nccl"
    assert _device_backend("cpu:gloo,cuda:gloo", "cpu") == "gloo" and _device_backend("GLOO", "cpu") == "gloo"
    assert _device_backend("my_custom_backend", "cpu") is None  # unknown capability: not refused


@pytest.mark.parametrize("config, ok", [("cpu:gloo,cuda:nccl", True), ("cpu:gloo,cuda:gloo", True),
                                        ("cuda:nccl", False)])
def test_group_backend_is_checked_for_q_device(monkeypatch, config, ok):
    """A mixed cpu:gloo,cuda:nccl group (the default init_process_group() on a GPU machine) serves CPU tensors
    with gloo: accepted. A NCCL-only group cannot move CPU tensors: a clear error before any collective."""
    import torch.distributed as dist

    from cp_packing.attention.plan import resolve_attention_group

    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(torch.ones(1, 8, dtype=torch.int64)),
                                      cp_size=2, cp_rank=1, layout="contiguous")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    if ok:
        resolve_attention_group(None, sharded, torch.device("cpu"))
    else:
        with pytest.raises(ValueError, match=r"cuda:nccl.*no backend for cpu tensors.*move q/k/v to CUDA"):
            resolve_attention_group(None, sharded, torch.device("cpu"))


def test_ring_import_failure_is_not_retried_on_every_layer_call(monkeypatch, tmp_path):
    """backend="auto" asks whether ring-flash-attn imports on every attention call: a failed import is remembered
    (per sys.path: a package dir put on sys.path later, as the tests do with the flash_attn stand-in, is tried)."""
    import cp_packing.attention.ring as ring
    from cp_packing import _imports
    from cp_packing.attention import plan

    attempts = []

    def failing_import():
        attempts.append(1)
        raise ImportError("ring-flash-attn is not installed")

    monkeypatch.setattr(ring, "import_ring_flash_attn", failing_import)
    monkeypatch.delitem(sys.modules, "ring_flash_attn", raising=False)  # an earlier test may have imported it
    _imports.forget_import_failures()
    assert [plan._ring_importable() for _ in range(3)] == [False] * 3
    assert len(attempts) == 1
    monkeypatch.syspath_prepend(str(tmp_path))  # something new on sys.path: tried again, once
    assert not plan._ring_importable() and not plan._ring_importable()
    assert len(attempts) == 2
    monkeypatch.setattr(ring, "import_ring_flash_attn", lambda: ring)  # installed meanwhile (any module)
    assert not plan._ring_importable()  # same sys.path: still the remembered failure
    _imports.forget_import_failures()
    assert plan._ring_importable()
    _imports.forget_import_failures()
