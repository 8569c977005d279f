"""``sum_gradients`` and ``param_digest`` (cp_packing/gradients.py): after the CP loss's backward and the sum, every
rank holds the single-process gradient of the global batch; a rank whose gradients differ raises on every rank."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp_packing
from cp_packing import CPMesh, param_digest, sum_gradients
from cp_packing.loss import next_token_labels, packed_cross_entropy
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.testing import run_distributed
from tests.test_loss import IGNORE, make_batch, make_model

RTOL, ATOL = 1e-5, 1e-7


def _batches(dp: int, cp: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One ``(doc_ids, input_ids, labels)`` batch per DP replica, each with its own padding (other valid counts)."""
    out = []
    for replica in range(dp):
        doc, ids = make_batch(90 + replica, 2, 8 * cp, multiple=2 * cp, pad_p=0.1 + 0.3 * replica)
        out.append((doc, ids, next_token_labels(ids, doc)))
    return out


def _reference_grads(batches) -> list[torch.Tensor]:
    """One process, the union of the replicas' batches: the token mean of the cross-entropy, its gradient."""
    model = make_model()
    ids = torch.cat([ids.reshape(-1) for _, ids, _ in batches])
    labels = torch.cat([lab.reshape(-1) for _, _, lab in batches])
    F.cross_entropy(model(ids), labels, ignore_index=IGNORE).backward()
    return [p.grad.clone() for p in model.parameters()]


def _cp_backward(batch, cp: int, cp_rank: int, group, dp_group=None) -> torch.nn.Module:
    """This rank's share of the global loss (the library's CP loss on its zigzag shard), backward, no sum."""
    doc, ids, labels = batch
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=cp, cp_rank=cp_rank,
                                      layout="zigzag")
    model = make_model()
    share = packed_cross_entropy(model(sharded.shard(ids)), sharded.shard(labels), group=group, dp_group=dp_group,
                                 sharded=sharded)
    share.backward()
    return model


def _raised(fn) -> str:
    t0 = time.monotonic()
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc} ({time.monotonic() - t0:.1f} s)"
    return "no error"


def _cp_worker(rank: int, world_size: int) -> dict:
    group = dist.group.WORLD
    batch = _batches(1, world_size)[0]
    ref = _reference_grads([batch])
    out = {}

    model = _cp_backward(batch, world_size, rank, group)
    local = [p.grad.clone() for p in model.parameters()]
    sum_gradients(model, group)
    out["summed"] = [float(((p.grad - r).abs() / r.abs().max()).max()) for p, r in zip(model.parameters(), ref)]
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=RTOL, atol=ATOL)
    out["local_differs"] = not all(torch.allclose(g, r, rtol=1e-3) for g, r in zip(local, ref))

    # Many small buckets (one per gradient here), and the mesh's method: the same sums.
    for summing in (lambda m: sum_gradients(m, group, bucket_mb=1e-5),
                    lambda m: CPMesh.from_groups(group).sum_gradients(m)):
        model = _cp_backward(batch, world_size, rank, group)
        summing(model)
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.grad, r, rtol=RTOL, atol=ATOL)

    # A parameter with a .grad on rank 0 only: an error on every rank (missing="raise"), or zeros on rank 1.
    model = _cp_backward(batch, world_size, rank, group)
    rank0_bias = model[1].bias.grad.clone()
    dist.broadcast(rank0_bias, src=0)
    if rank == 1:
        model[1].bias.grad = None
    out["missing"] = _raised(lambda: sum_gradients(model, group))
    sum_gradients(model, group, missing="zeros")
    torch.testing.assert_close(model[1].bias.grad, rank0_bias)
    # A rank that skipped its backward altogether.
    model = _cp_backward(batch, world_size, rank, group)
    if rank == 1:
        model.zero_grad(set_to_none=True)
    out["no_backward"] = _raised(lambda: sum_gradients(model, group))
    # Another model on one rank.
    other = make_model() if rank == 0 else torch.nn.Linear(3, 3)
    out["other_model"] = _raised(lambda: sum_gradients(other, group))

    # FSDP2 parameters (DTensors) and DDP: refused on every rank, naming the framework that reduces.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    dtensor = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
    dtensor.grad = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    out["dtensor"] = _raised(lambda: sum_gradients([dtensor], group))
    out["ddp"] = _raised(lambda: sum_gradients(torch.nn.parallel.DistributedDataParallel(make_model()), group))
    return out


@pytest.mark.distributed
def test_cp_sum_equals_the_single_process_gradient_and_mistakes_raise_everywhere():
    """2 gloo ranks (CP only): the summed gradients equal the one-process gradient of the batch (the local ones do
    not); a parameter without a .grad on one rank, a rank without backward, another model, FSDP2 DTensors and DDP
    raise on both ranks (the hard timeout of 120 s stands for a hang)."""
    results = run_distributed(_cp_worker, 2, timeout=120)
    for r in results:
        assert r["local_differs"], "the test cannot fail: the local gradients already equal the reference"
        assert "disagree on parameters with a .grad" in r["missing"] and "1.bias" in r["missing"], r["missing"]
        assert "missing='zeros'" in r["missing"], r["missing"]
        assert "none of 3 (no backward on this rank?)" in r["no_backward"], r["no_backward"]
        assert "disagree on parameter shapes and dtypes" in r["other_model"], r["other_model"]
        assert r["dtensor"].startswith("TypeError") and "FSDP2" in r["dtensor"], r["dtensor"]
        assert r["ddp"].startswith("TypeError") and "DistributedDataParallel" in r["ddp"], r["ddp"]
    assert [r["missing"].split(" (")[0] for r in results] == [results[0]["missing"].split(" (")[0]] * 2


def _dp_cp_worker(rank: int, world_size: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    dp, cp = 2, 2
    device_mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    mesh = CPMesh.from_device_mesh(device_mesh)
    batches = _batches(dp, cp)
    ref = _reference_grads(batches)
    worst = []
    for target in (device_mesh, mesh):  # the 2-D DeviceMesh itself, or the CPMesh
        model = _cp_backward(batches[mesh.dp_rank], cp, mesh.cp_rank, mesh.cp_group, mesh.dp_group)
        sum_gradients(model, target)
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.grad, r, rtol=RTOL, atol=ATOL)
        worst.append(max(float((p.grad - r).abs().max()) for p, r in zip(model.parameters(), ref)))
    # Summed over CP only (the DP replicas forgotten): not the global gradient.
    model = _cp_backward(batches[mesh.dp_rank], cp, mesh.cp_rank, mesh.cp_group, mesh.dp_group)
    sum_gradients(model, mesh.cp_group)
    assert not all(torch.allclose(p.grad, r, rtol=1e-3) for p, r in zip(model.parameters(), ref))
    # Global rank 3 (replica 1, CP rank 1) without a .grad: its CP group finds it, and the other replica's ranks,
    # whose own CP group agrees, learn it from the DP group: all four raise.
    model = _cp_backward(batches[mesh.dp_rank], cp, mesh.cp_rank, mesh.cp_group, mesh.dp_group)
    if dist.get_rank() == 3:
        model[0].weight.grad = None
    with pytest.raises(ValueError, match="parameters with a .grad.*missing='zeros'"):
        sum_gradients(model, mesh)
    return worst


@pytest.mark.distributed
def test_dp_x_cp_sum_equals_the_single_process_gradient_of_the_global_batch():
    """4 gloo ranks, DP 2 x CP 2, the replicas with different valid-label counts: the SUM over CP and DP of the
    library's CP loss gradients equals the one-process gradient of the union of the replicas' batches; one rank
    without a .grad raises on all four."""
    for worst in run_distributed(_dp_cp_worker, 4, timeout=120):
        assert max(worst) < 1e-5, worst


# ------------------------------------------------------------------------------------------ one process


def test_one_process_sum_is_a_no_op_and_bad_arguments_raise():
    model = make_model()
    model(torch.tensor([1, 2, 3])).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    sum_gradients(model, CPMesh.from_ints())
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="unknown missing 'skip'"):
        sum_gradients(model, CPMesh.from_ints(), missing="skip")
    with pytest.raises(TypeError, match="iterable of parameters"):
        sum_gradients(model.parameters().__next__(), CPMesh.from_ints())
    with pytest.raises(ValueError, match="cp_size=2 but no cp process group"):
        sum_gradients(model, CPMesh.from_ints(cp_size=2))
    with pytest.raises(ValueError, match="not initialized"):
        sum_gradients(model, None)  # the world, which does not exist here
    assert cp_packing.sum_gradients is sum_gradients


def test_param_digest_tells_equal_weights_from_drifted_ones():
    a = torch.nn.Sequential(torch.nn.Embedding(5000, 8), torch.nn.Linear(8, 3))  # 40k elements: sampled
    b = torch.nn.Sequential(torch.nn.Embedding(5000, 8), torch.nn.Linear(8, 3))
    b.load_state_dict(a.state_dict())
    assert param_digest(a) == param_digest(b) == param_digest(list(b.parameters()))
    assert param_digest(a) != param_digest(torch.nn.Sequential(torch.nn.Embedding(5000, 8), torch.nn.Linear(8, 3)))
    with torch.no_grad():
        b[1].weight[2, 5] += 1e-6  # a small parameter: every element is read
    assert param_digest(a) != param_digest(b)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b[0].weight[0, 0] += 1e-6  # element 0 of a large one: always in the sample
    assert param_digest(a) != param_digest(b)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b[1].bias[[0, 1]] = b[1].bias[[1, 0]]  # a swap keeps the plain sum
    assert param_digest(a) != param_digest(b)
    b.load_state_dict(a.state_dict())
    assert param_digest(a) == param_digest(b.to(torch.float64).to(torch.float32))
    assert param_digest(a) != param_digest(b.to(torch.bfloat16))  # the dtype counts
    with pytest.raises(ValueError, match="sample must be >= 1"):
        param_digest(a, sample=0)


# ------------------------------------------------------------------------------------- the drifted-weights guard


def _loop_worker(rank: int, world_size: int, summed: bool) -> tuple[str, float]:
    import time

    from transformers import AutoModelForCausalLM, LlamaConfig

    from cp_packing import distribute_batch, next_token_labels, packed_cross_entropy, packed_seq_params_from_doc_ids
    from cp_packing.hf import cp_model_inputs, register_cp_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, attention_dropout=0.0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register_cp_attention())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    group = dist.group.WORLD
    start = time.monotonic()
    try:
        for step in range(3):
            doc = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4])
            ids = torch.randint(0, 64, doc.shape, generator=torch.Generator().manual_seed(step))
            local, sharded = distribute_batch({"input_ids": ids, "labels": next_token_labels(ids, doc)},
                                              packed_seq_params_from_doc_ids(doc), group=group, layout="contiguous")
            start = time.monotonic()
            inputs = cp_model_inputs(local, sharded, group=group, model=model)
            loss = packed_cross_entropy(model(**inputs).logits[0], local["labels"][0], sharded=inputs["cp_sharded"])
            loss.backward()
            if summed:
                cp_packing.sum_gradients(model, group)
            opt.step()
            opt.zero_grad(set_to_none=True)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return "ok", time.monotonic() - start


@pytest.mark.distributed
def test_a_loop_that_skips_the_gradient_sum_is_stopped_on_every_rank():
    """Without ``sum_gradients`` the CP ranks' weights drift apart after the first optimizer step (each rank stepped
    on its own shard's gradient) and training would go on silently; the next checked step's agreement compares a
    digest of the weights and raises on every rank within seconds, naming the fix. With the sum, three steps run."""
    pytest.importorskip("transformers")
    for message, seconds in run_distributed(_loop_worker, 2, False):
        assert message.startswith("AgreementError") and "weights differ" in message, message
        assert "cp_packing.sum_gradients(model, cp_group)" in message and seconds < 30, (message, seconds)
    assert [m for m, _ in run_distributed(_loop_worker, 2, True)] == ["ok", "ok"]
