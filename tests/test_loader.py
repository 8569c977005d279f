"""The DP x CP loader: every CP rank of a replica gets the same packed batch, the replicas get different ones, every
document of the epoch lands in exactly one replica's batch once, whatever ``num_workers`` is, and the metadata the
DataLoader workers computed is what the step would compute; a tiny HF Llama fed from loader items, two micro-batches
of gradient accumulation normalised by ``num_items_in_batch``, gives the loss and gradients of the model on the whole
optimizer step (unsharded, all replicas, all micro-batches) in one process.

References are independent of the loader: the documents are compared as token sequences recovered from the doc maps
(``tests.maps.runs_of_row``), the metadata against ``packed_seq_params_from_doc_ids`` / ``shard_packed_seq_params``
called at step time, the model against HF eager attention with a block-diagonal causal mask (``tests.test_hf``).
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.loader import (
    CPBatch,
    CPCollator,
    CPPackedDataset,
    ReplicaBatchSampler,
    ReplicaRank,
    cp_dataloader,
    make_cp_batch,
    num_items_in_batch,
    replica_rank,
)
from cp_packing.groups import CPMesh
from cp_packing.loss import next_token_labels
from cp_packing.testing import run_distributed
from tests.maps import runs_of_row

datasets = pytest.importorskip("datasets")

SEQ, ROWS, DP, CP = 32, 2, 2, 2
VOCAB = 128


def make_documents(n: int = 60, seed: int = 0) -> dict[str, list]:
    """Columns of a tokenized dataset: ``input_ids`` (3 to 20 tokens), HF ``labels`` with a masked prompt on every
    third document, and a ``text`` column the loader must ignore."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for i in range(n):
        doc = rng.integers(1, VOCAB, size=int(rng.integers(3, 21))).tolist()
        ids.append(doc)
        labels.append([-100] * 2 + doc[2:] if i % 3 == 0 else list(doc))
    return {"input_ids": ids, "labels": labels, "text": [f"doc {i}" for i in range(n)]}


def documents_of(batches: list[dict]) -> Counter:
    """Every document (a run of one doc id inside a row) of the given replica batches, as a token tuple."""
    out = Counter()
    for batch in batches:
        for ids, doc in zip(batch["input_ids"].tolist(), batch["doc_ids"].tolist()):
            out.update(tuple(ids[a:b]) for value, a, b in runs_of_row(doc) if value != 0)
    return out


def check_item_against_step(item: CPBatch, cp_size: int, cp_rank: int, layout: str = "balanced") -> None:
    """What the worker computed equals what the step would compute from the replica batch."""
    batch = item.batch
    params = packed_seq_params_from_doc_ids(batch["doc_ids"])
    sharded = shard_packed_seq_params(params, cp_size=cp_size, cp_rank=cp_rank, layout=layout)
    assert torch.equal(item.params.cu_seqlens, params.cu_seqlens) and item.params.max_seqlen == params.max_seqlen
    assert item.sharded.global_params is item.params and item.sharded.layout == sharded.layout
    for name in ("token_index", "doc_ids", "position_ids", "cu_seqlens", "key_start"):
        assert torch.equal(getattr(item.sharded, name), getattr(sharded, name)), name
    assert (item.sharded.cp_size, item.sharded.cp_rank, item.sharded.max_seqlen) == (cp_size, cp_rank,
                                                                                         sharded.max_seqlen)
    for key in ("input_ids", "labels", "doc_ids"):
        assert torch.equal(item.local[key][0], sharded.shard(batch[key])), key
    assert torch.equal(item.local["position_ids"][0], sharded.position_ids)
    assert item.num_valid_labels == int((batch["labels"] != -100).sum())


def hf_labels_respected(batch: dict) -> bool:
    """Shifted labels on the global stream, as next_token_labels gives them, with HF prompt masks only removing."""
    plain = next_token_labels(batch["input_ids"], batch["doc_ids"])
    got = batch["labels"]
    return bool(((got == plain) | (got == -100)).all())


# ------------------------------------------------------------------------------------------------ one process


def test_make_cp_batch_equals_the_step_computation_and_survives_pickling():
    doc = torch.tensor([[1] * 5 + [2] * 9 + [0] * 2, [1] * 12 + [2] * 4])
    ids = torch.randint(1, VOCAB, doc.shape, generator=torch.Generator().manual_seed(0))
    for cp_rank in range(2):
        item = make_cp_batch({"input_ids": ids, "doc_ids": doc}, cp_size=2, cp_rank=cp_rank)
        assert torch.equal(item.batch["labels"], next_token_labels(ids, doc))  # built when absent
        check_item_against_step(item, 2, cp_rank)
        copy = pickle.loads(pickle.dumps(item))
        check_item_against_step(copy, 2, cp_rank)
        # the batch's doc map, params.doc_ids and the shard's global params stay one object after pickling
        assert copy.batch["doc_ids"] is copy.params.doc_ids and copy.sharded.global_params is copy.params
        with pytest.raises(ValueError, match=r"\[rows, seq_len\]"):
            make_cp_batch({"input_ids": ids.view(-1), "doc_ids": doc.view(-1)}, cp_size=2, cp_rank=0)
        with pytest.raises(ValueError, match="has no 'doc_ids'"):
            make_cp_batch({"input_ids": ids}, cp_size=2, cp_rank=0)
        with pytest.raises(ValueError, match="batch\\['labels'\\] has shape"):
            make_cp_batch({"input_ids": ids, "doc_ids": doc, "labels": ids[:, :3]}, cp_size=2, cp_rank=0)
        moved = copy.to("cpu")
        assert moved.sharded.global_params is moved.params
        assert moved.local["input_ids"].shape == (1, doc.numel() // 2)


def test_replica_rank_ways_and_errors():
    assert replica_rank(cp_rank=1, cp_size=2) == ReplicaRank(0, 1, 1, 2)
    with pytest.raises(TypeError, match="exactly one"):
        replica_rank()
    with pytest.raises(TypeError, match="exactly one"):
        replica_rank(cp_rank=0, cp_size=2, cp_group=object())
    with pytest.raises(TypeError, match="cp_rank= and cp_size="):
        replica_rank(dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank must be <= 1"):
        replica_rank(dp_rank=2, dp_size=2, cp_rank=0, cp_size=1)
    with pytest.raises(ValueError, match=r"cp_rank must be <= 1"):
        ReplicaRank(0, 1, 2, 2)


def test_dataset_refuses_what_would_lose_or_duplicate_documents():
    place = ReplicaRank(0, 1, 0, 2)
    with pytest.raises(TypeError, match="one-shot iterator"):
        CPPackedDataset((d for d in [[1, 2]]), seq_len=4, rows=1, placement=place)
    ds = datasets.Dataset.from_dict(make_documents(8)).to_iterable_dataset(num_shards=2)
    from datasets.distributed import split_dataset_by_node

    split = split_dataset_by_node(ds, rank=0, world_size=2)
    with pytest.raises(ValueError, match="split_dataset_by_node"):
        CPPackedDataset(split, seq_len=4, rows=1, placement=place)
    with pytest.raises(ValueError, match="not divisible by cp_size=2"):
        CPPackedDataset([[1, 2]], seq_len=5, rows=2, placement=place)
    with pytest.raises(ValueError, match="needs 'input_ids'"):
        list(CPPackedDataset([{"ids": [1, 2]}], seq_len=4, rows=1, placement=place))
    with pytest.raises(TypeError, match="ReplicaRank"):
        CPPackedDataset([[1, 2]], seq_len=4, rows=1, placement=(0, 1, 0, 2))

    def bad_packer(documents, **kwargs):
        yield [{}]  # one replica batch for dp_size 2

    with pytest.raises(ValueError, match="expected dp_size=2"):
        list(CPPackedDataset([[1, 2]], seq_len=4, rows=1, placement=ReplicaRank(0, 2, 0, 1), packer=bad_packer))


def test_shuffle_is_deterministic_per_epoch_and_loses_nothing():
    docs = datasets.Dataset.from_dict(make_documents(40, seed=3))
    place = ReplicaRank(0, 1, 0, 1)

    def epoch_docs(epoch: int) -> list:
        ds = CPPackedDataset(docs, seq_len=SEQ, rows=ROWS, placement=place, shuffle=True, seed=7)
        ds.set_epoch(epoch)
        return [tuple(x.tolist()) for item in ds for x in item.batch["input_ids"]]

    e0, e0_again, e1 = epoch_docs(0), epoch_docs(0), epoch_docs(1)
    assert e0 == e0_again and e0 != e1
    want = Counter(tuple(d) for d in docs["input_ids"])
    for epoch in (0, 1):
        ds = CPPackedDataset(docs, seq_len=SEQ, rows=ROWS, placement=place, shuffle=True, seed=7)
        ds.set_epoch(epoch)
        assert documents_of([item.batch for item in ds]) == want
    # persistent workers see set_epoch too (the epoch lives in shared memory)
    loader = cp_dataloader(docs, seq_len=SEQ, rows=ROWS, placement=place, shuffle=True, seed=7,
                           num_workers=1, persistent_workers=True)
    for epoch, expected in ((0, e0), (1, e1)):
        loader.dataset.set_epoch(epoch)
        assert [tuple(x.tolist()) for item in loader for x in item.batch["input_ids"]] == expected


def test_prepacked_rows_sampler_and_collator_in_workers():
    """Already-packed rows: every row used once per epoch over the replicas, CP peers identical, the replica left
    without rows at the end gets one all-padding row; the position_ids route gives the doc_ids route's batch."""
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(9):  # 9 rows, 2 per replica per step, dp 2: steps of 4, 4, then 1 row (replica 1: none)
        lengths = [int(x) for x in rng.integers(2, 9, size=3)]
        doc = [i + 1 for i, n in enumerate(lengths) for _ in range(n)][:SEQ]
        doc += [0] * (SEQ - len(doc))
        pos, prev = [], None
        for d in doc:
            pos.append(0 if d != prev else pos[-1] + 1)
            prev = d
        rows.append({"input_ids": rng.integers(1, VOCAB, size=SEQ).tolist(), "doc_ids": doc, "position_ids": pos,
                     "attention_mask": [int(d != 0) for d in doc]})
    by_pos = [{k: r[k] for k in ("input_ids", "position_ids", "attention_mask")} for r in rows]
    got = {}
    for dp_rank in range(DP):
        for cp_rank in range(CP):
            place = ReplicaRank(dp_rank, DP, cp_rank, CP)
            for source, workers in ((rows, 2), (by_pos, 0)):
                loader = torch.utils.data.DataLoader(
                    source, batch_sampler=ReplicaBatchSampler(len(source), rows=ROWS, placement=place),
                    collate_fn=CPCollator(place, seq_len=SEQ), num_workers=workers)
                items = list(loader)
                for item in items:
                    check_item_against_step(item, CP, cp_rank)
                got.setdefault(dp_rank, []).append([{k: v for k, v in it.batch.items()} for it in items])
    for dp_rank, runs in got.items():
        first = runs[0]
        assert len(first) == 3  # every replica runs the same number of steps
        for other in runs[1:]:  # CP peers and the position_ids route: identical batches
            assert all(torch.equal(a[k].long(), b[k].long()) for a, b in zip(first, other) for k in a)
    last = got[1][0][-1]
    assert last["doc_ids"].shape == (1, SEQ) and not last["doc_ids"].any() and (last["labels"] == -100).all()
    seen = Counter(tuple(x.tolist()) for r in (0, 1) for b in got[r][0] for x, d in zip(b["input_ids"], b["doc_ids"])
                   if d.any())
    assert seen == Counter(tuple(r["input_ids"]) for r in rows)


# ------------------------------------------------------------------------------------------------ 4 ranks, dp 2 x cp 2


def _loader_worker(rank: int, world: int, columns: dict, model) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from cp_packing.hf import cp_model_inputs
    from cp_packing.loss import count_valid_labels, packed_cross_entropy

    # run_ranks forks daemonic ranks, and a daemonic process may not start DataLoader workers; torchrun's ranks
    # are not daemonic.
    multiprocessing.current_process().daemon = False
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    place = replica_rank(mesh)
    assert isinstance(place, CPMesh) and (place.dp_rank, place.dp_size, place.cp_rank, place.cp_size) == (
        rank // CP, DP, rank % CP, CP)
    assert place.cp_group is mesh["cp"].get_group() and place.device_mesh is mesh
    ds = datasets.Dataset.from_dict(columns)
    sources = {"map": ds, "iterable": ds.to_iterable_dataset(num_shards=2)}
    out: dict = {"runs": {}}
    for kind, source in sources.items():
        for workers in (0, 2):
            items = list(cp_dataloader(source, seq_len=SEQ, rows=ROWS, mesh=mesh, num_workers=workers))
            for item in items:
                check_item_against_step(item, CP, place.cp_rank)
            out["runs"][(kind, workers)] = {
                "steps": [item.step for item in items],
                "batches": [{k: v.numpy().copy() for k, v in item.batch.items()} for item in items],
                "hf_labels_ok": all(hf_labels_respected(item.batch) for item in items),
            }
            if kind == "map" and workers == 2:
                crossed = items[:2]
    sharded = crossed[0].sharded  # an item that crossed the worker boundary still shards and unshards alike
    assert torch.equal(sharded.global_token_order(), sharded.global_token_order())

    # Two micro-batches of gradient accumulation from loader items: each share over the step's count of labels
    # (num_items_in_batch: both micro-batches, both replicas), gradients accumulated, then SUM-reduced over all.
    cp_group, dp_group = mesh["cp"].get_group(), mesh["dp"].get_group()
    n = num_items_in_batch(crossed, dp_group=mesh["dp"])
    assert n == count_valid_labels([item.batch["labels"] for item in crossed], dp_group=dp_group)
    model.zero_grad(set_to_none=True)
    shares = []
    for item in crossed:
        item = item.to("cpu")
        logits = model(**cp_model_inputs(item.local, item.sharded, group=cp_group)).logits[0]  # [T_local, V]
        share = packed_cross_entropy(logits, item.local["labels"][0], group=cp_group, dp_group=dp_group,
                                     num_items_in_batch=n)
        share.backward()
        shares.append(float(share.detach()))
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[name] = g.numpy()
    every = [None] * world
    dist.all_gather_object(every, shares)
    out["parity"] = {"shares": every, "grads": grads, "num_items": n}
    return out


@pytest.mark.distributed
def test_dp2_cp2_loader_gives_replicas_their_share_and_the_model_its_loss():
    from tests.test_hf import NAME, assert_grads_close, make_model, reference

    columns = make_documents(60)
    results = run_distributed(_loader_worker, DP * CP, columns, make_model("llama", NAME))
    want = Counter(tuple(d) for d in columns["input_ids"])
    n_steps = len(results[0]["runs"][("map", 0)]["steps"])
    assert n_steps >= 3
    for rank, result in enumerate(results):
        first = result["runs"][("map", 0)]
        for key, run in result["runs"].items():
            assert run["steps"] == list(range(n_steps)), (rank, key)  # in step order, none lost or repeated
            assert run["hf_labels_ok"], (rank, key)
            peer = results[rank ^ 1]["runs"][key]  # the other CP rank of this replica: the same batches
            other = results[rank ^ 2]["runs"][key]  # the other replica's rank with this CP rank: other batches
            for mine, theirs, elsewhere in zip(run["batches"], peer["batches"], other["batches"]):
                assert all(np.array_equal(mine[k], theirs[k]) for k in mine)
                assert not np.array_equal(mine["input_ids"], elsewhere["input_ids"])
            # the same steps whatever the source kind and num_workers: the packer over the same stream
            assert all(np.array_equal(a[k], b[k]) for a, b in zip(run["batches"], first["batches"]) for k in a)
        if rank % CP == 0:
            for key in result["runs"]:  # the union over the two replicas: every document exactly once
                union = [{k: torch.from_numpy(v) for k, v in b.items()}
                         for r in (0, CP) for b in results[r]["runs"][key]["batches"]]
                assert documents_of(union) == want, key

    # The model on the whole optimizer step (2 micro-batches x 2 replicas, one process): the same loss and gradients.
    batches = [results[r]["runs"][("map", 2)]["batches"][i] for r in (0, CP) for i in (0, 1)]
    doc = torch.cat([torch.from_numpy(b["doc_ids"]).long() for b in batches])
    ids = torch.cat([torch.from_numpy(b["input_ids"]) for b in batches])
    labels = torch.cat([torch.from_numpy(b["labels"]) for b in batches])
    _, ref_loss, ref_grads = reference(make_model("llama", "eager"), doc, ids, labels)
    parity = results[0]["parity"]
    total = torch.tensor(sum(sum(s) for s in parity["shares"]), dtype=torch.float32)
    torch.testing.assert_close(total, ref_loss, rtol=1e-4, atol=1e-5)
    assert all(abs(x) > 0 for s in parity["shares"] for x in s)  # genuine shares on every rank and micro-batch
    assert_grads_close({n: torch.from_numpy(g) for n, g in parity["grads"].items()}, ref_grads)
    assert all(r["parity"]["num_items"] == int((labels != -100).sum()) for r in results)


# ------------------------------------------------------------------------------------------------ resuming


def step_keys(items) -> list:
    return [(item.step, {k: v.tolist() for k, v in item.batch.items()}) for item in items]


def test_state_dict_resumes_with_the_uninterrupted_runs_steps_whatever_num_workers():
    """Consume k steps, save the loader's state (torch.save / torch.load(weights_only=True)), build a new loader,
    load the state: the following steps equal the uninterrupted run's, exactly, with 0, 1 and 2 workers."""
    import io

    docs = datasets.Dataset.from_dict(make_documents(150, seed=2))
    place = CPMesh.from_ints(dp_rank=1, dp_size=DP, cp_rank=0, cp_size=CP)
    full = step_keys(cp_dataloader(docs, seq_len=SEQ, rows=ROWS, placement=place, shuffle=True, seed=3))
    assert len(full) >= 8
    for workers, ks in ((0, (0, 1, 5, len(full) - 1, len(full))), (1, (3,)), (2, (0, 5))):
        for k in ks:
            loader = cp_dataloader(docs, seq_len=SEQ, rows=ROWS, placement=place, shuffle=True, seed=3,
                                   num_workers=workers)
            items = iter(loader)
            head = step_keys(next(items) for _ in range(k))
            buffer = io.BytesIO()
            torch.save(loader.state_dict(), buffer)
            buffer.seek(0)
            state = torch.load(buffer, weights_only=True)
            del items
            resumed = cp_dataloader(docs, seq_len=SEQ, rows=ROWS, placement=place, shuffle=True, seed=3,
                                    num_workers=workers)
            resumed.load_state_dict(state)
            resumed.dataset.set_epoch(0)  # the same epoch keeps the loaded step
            assert head + step_keys(resumed) == full, (workers, k)
    # after the epoch, set_epoch moves the state to the next epoch's step 0
    loader = cp_dataloader(docs, seq_len=SEQ, rows=ROWS, placement=place)
    list(loader)
    assert (loader.state_dict()["epoch"], loader.state_dict()["next_step"]) == (0, len(full))
    loader.dataset.set_epoch(1)
    assert (loader.state_dict()["epoch"], loader.state_dict()["next_step"]) == (1, 0)
    with pytest.raises(ValueError, match=r"saved by a loader with rows=4 \(this loader: 2\)"):
        cp_dataloader(docs, seq_len=SEQ, rows=ROWS, placement=place).load_state_dict(
            cp_dataloader(docs, seq_len=SEQ, rows=4, placement=place).state_dict())


def test_torchdata_stateful_dataloader_resumes_the_dataset_exactly():
    """The dataset follows torchdata's Stateful protocol: a StatefulDataLoader saves each worker's position."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    docs = datasets.Dataset.from_dict(make_documents(150, seed=4))
    place = CPMesh.from_ints(dp_rank=0, dp_size=DP, cp_rank=1, cp_size=CP)
    full = step_keys(CPPackedDataset(docs, seq_len=SEQ, rows=ROWS, placement=place))
    for workers, k in ((0, 4), (1, 3)):
        loader = stateful.StatefulDataLoader(CPPackedDataset(docs, seq_len=SEQ, rows=ROWS, placement=place),
                                             batch_size=None, num_workers=workers)
        items = iter(loader)
        head = step_keys(next(items) for _ in range(k))
        state = loader.state_dict()
        del items
        resumed = stateful.StatefulDataLoader(CPPackedDataset(docs, seq_len=SEQ, rows=ROWS, placement=place),
                                              batch_size=None, num_workers=workers)
        resumed.load_state_dict(state)
        assert head + step_keys(resumed) == full, workers


# ------------------------------------------------------------------------------------------------ checked at build


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"bufer_tokens": 4096}, TypeError, r"the packer's arguments .*\['bufer_tokens'\].*unexpected keyword argument "
                                        r"'bufer_tokens'"),
    ({"long_documents": "drop"}, ValueError, "unknown long_documents 'drop'"),
    ({"buffer_tokens": 3}, ValueError, "holds less than one step"),
    ({"layout": "zigzg"}, ValueError, "unknown layout 'zigzg'"),
])
def test_packer_arguments_are_checked_when_the_loader_is_built(kwargs, exc, match):
    """They used to fail only at the first batch, inside a worker."""
    place = CPMesh.from_ints(cp_size=2)
    with pytest.raises(exc, match=match):
        cp_dataloader([[1, 2, 3]], seq_len=8, rows=1, placement=place, num_workers=2, **kwargs)


def test_a_custom_packer_is_bound_to_its_arguments_when_the_loader_is_built():
    def packer(documents, *, seq_len, rows, dp_size):
        yield from ()

    place = CPMesh.from_ints(cp_size=1)
    assert list(cp_dataloader([[1, 2]], seq_len=8, rows=1, placement=place, packer=packer)) == []
    with pytest.raises(TypeError, match="unexpected keyword argument 'seed_'"):
        cp_dataloader([[1, 2]], seq_len=8, rows=1, placement=place, packer=packer, seed_=1)


# ------------------------------------------------------------------------------------------------ labels


def test_make_cp_batch_refuses_unsigned_labels_and_hf_unshifted_labels_naming_next_token_labels():
    doc = torch.tensor([[1, 1, 1, 2, 2, 0]])
    ids = torch.tensor([[5, 6, 7, 8, 9, 0]])
    shifted = next_token_labels(ids, doc)
    item = make_cp_batch({"input_ids": ids, "doc_ids": doc, "labels": shifted}, cp_size=2, cp_rank=0)
    assert item.num_valid_labels == 3
    with pytest.raises(TypeError, match=r"labels'\] has dtype torch.uint8, which cannot hold -100 .*156.*\.long\(\)"):
        make_cp_batch({"input_ids": ids, "doc_ids": doc, "labels": shifted.clamp(min=0).to(torch.uint8)},
                      cp_size=4, cp_rank=0)
    hf = ids.masked_fill(doc == 0, -100)  # HF's unshifted convention: labels = input_ids
    with pytest.raises(ValueError, match=r"HF-style UNSHIFTED labels.*labels\[0, 2\] = 7 is at the last token of its "
                                         r"document.*cp_packing.next_token_labels\(input_ids, doc_ids, labels="):
        make_cp_batch({"input_ids": ids, "doc_ids": doc, "labels": hf}, cp_size=2, cp_rank=0)
    on_padding = shifted.clone()
    on_padding[0, 5] = 3
    with pytest.raises(ValueError, match=r"labels'\]\[0, 5\] is 3 on padding \(doc id 0\); shifted labels are -100"):
        make_cp_batch({"input_ids": ids, "doc_ids": doc, "labels": on_padding}, cp_size=2, cp_rank=0)
    collator = CPCollator(CPMesh.from_ints(cp_size=2), seq_len=6)
    with pytest.raises(ValueError, match="HF-style UNSHIFTED labels"):
        collator([{"input_ids": ids[0].tolist(), "doc_ids": doc[0].tolist(), "labels": hf[0].tolist()}])


# ------------------------------------------------------------------------------------------------ obscure inputs


def test_replica_batch_sampler_num_rows():
    place = CPMesh.from_ints(dp_rank=0, dp_size=2)
    assert list(ReplicaBatchSampler(np.int64(5), rows=1, placement=place)) == [[0], [2], [4]]
    assert len(ReplicaBatchSampler(list(range(5)), rows=1, placement=place)) == 3
    for bad in (None, 5.0, "5", True):
        with pytest.raises(TypeError, match=r"num_rows must be the number of packed rows \(an int\) or the dataset"):
            ReplicaBatchSampler(bad, rows=1, placement=place)


@pytest.mark.parametrize("rows,exc,match", [
    ([{"input_ids": [[1, 2], [3]], "doc_ids": [1, 1, 1]}], ValueError,
     r"row 0\['input_ids'\] is not a flat sequence of ints \(list: ragged, nested"),
    ([{"input_ids": [1, 2, 3], "doc_ids": [[1, 1], [1, 1]]}], ValueError,
     r"row 0\['doc_ids'\] must be a 1-D integer sequence \[seq_len\], got torch.int64 \(2, 2\)"),
    (["abc"], TypeError, r"row 0 must be a dict .* got str; tokenize first"),
    ([{"input_ids": "hello", "doc_ids": [1, 1, 1]}], TypeError, r"row 0\['input_ids'\] is a string"),
    ([{"input_ids": [1, 2, 3], "doc_ids": [1, 1, 1], "labels": [2, 3, -100]}, {"input_ids": [1, 2, 3],
                                                                                "doc_ids": [1, 1, 1]}],
     ValueError, r"row 1 has keys \['doc_ids', 'input_ids'\] but row 0 has .*missing \['labels'\]"),
    ([{"input_ids": [1, 2, 3], "doc_ids": [1, 1, 1]}, {"input_ids": [1, 2, 3], "position_ids": [0, 1, 2]}],
     ValueError, r"row 1 has keys .*missing \['doc_ids'\]"),
    ("abc", TypeError, "CPCollator takes a list of rows"),
    ([{"input_ids": [1, 2, 3], "doc_ids": [1, 1, 1]}, {"input_ids": [1, 2], "doc_ids": [1, 1]}], ValueError,
     r"row 1\['input_ids'\] has 2 tokens; every packed row must have seq_len=3"),
])
def test_collator_refuses_ragged_string_and_mismatched_rows(rows, exc, match):
    collator = CPCollator(CPMesh.from_ints(cp_size=1), seq_len=3)
    with pytest.raises(exc, match=match):
        collator(rows)


def test_replica_rank_is_cp_mesh_and_cp_dataloader_takes_a_cp_mesh():
    assert ReplicaRank is CPMesh
    place = replica_rank(dp_rank=1, dp_size=2, cp_rank=1, cp_size=2)
    assert isinstance(place, CPMesh) and place.global_rank == 3
    assert replica_rank(place) is place
    with pytest.raises(TypeError, match="mesh must be a torch DeviceMesh"):
        replica_rank(object())
    docs = make_documents(20)["input_ids"]
    a = step_keys(cp_dataloader(docs, seq_len=SEQ, rows=ROWS, mesh=place))
    b = step_keys(cp_dataloader(docs, seq_len=SEQ, rows=ROWS, placement=pickle.loads(pickle.dumps(place))))
    assert a == b and len(a) >= 2


def test_one_cp_batch_builder_zigzag_pads_documents_and_matches_the_trainers_layout():
    """The loader and CPTrainer lay a batch out the same way (``pad_for_layout`` then ``shard_batch``): with
    ``zigzag`` every document grows to a multiple of ``2 * cp`` (pad tokens join their document, label -100, no valid
    label lost or added); the local tensors are this rank's shard of the padded batch."""
    from cp_packing.loader import pad_for_layout, shard_batch
    from cp_packing.trainer import cp_batch

    doc = torch.tensor([[1] * 5 + [2] * 9 + [0] * 2, [1] * 3 + [2] * 13])
    ids = torch.randint(1, VOCAB, doc.shape, generator=torch.Generator().manual_seed(1))
    labels = next_token_labels(ids, doc)
    cp = 2
    trainer = cp_batch({"input_ids": ids, "doc_ids": doc, "shift_labels": labels}, cp_size=cp, layout="zigzag")
    for cp_rank in range(cp):
        item = make_cp_batch({"input_ids": ids, "doc_ids": doc, "labels": labels}, cp_size=cp, cp_rank=cp_rank,
                             layout="zigzag")
        lengths = (item.params.cu_seqlens[1:] - item.params.cu_seqlens[:-1]).tolist()
        assert all(n % (2 * cp) == 0 for n in lengths), lengths
        assert item.num_valid_labels == int((labels != -100).sum())  # no label lost or added
        assert torch.equal(item.batch["labels"], trainer["shift_labels"])
        assert torch.equal(item.batch["input_ids"], trainer["input_ids"])
        assert torch.equal(item.batch["doc_ids"], trainer["doc_ids"])
        for key, value in item.batch.items():
            assert torch.equal(item.local[key], item.sharded.shard(value)[None])
        local, sharded = shard_batch(trainer, cp_size=cp, cp_rank=cp_rank, layout="zigzag")
        assert torch.equal(local["input_ids"], item.local["input_ids"])
        assert torch.equal(local["position_ids"], item.local["position_ids"])
    padded, undo = pad_for_layout({"input_ids": ids, "doc_ids": doc}, cp_size=cp, layout="contiguous")
    assert undo is None and torch.equal(padded["input_ids"], ids)  # rows already divide: nothing added


def test_seeds_must_be_non_negative():
    place = ReplicaRank(0, 1, 0, 2)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        CPPackedDataset([[1, 2, 3]], seq_len=4, rows=1, placement=place, seed=-1)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        ReplicaBatchSampler(4, rows=1, placement=place, seed=-1)
