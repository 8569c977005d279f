"""The FSDP2 + DeviceMesh recipe of docs/integration.md: an HF model trained with FSDP2 over a DP x CP mesh.

What a user relies on: one optimizer step of the recipe (``fully_shard`` over the flattened ``("dp", "cp")`` mesh,
``distribute_batch`` over ``mesh["cp"]``, ``packed_cross_entropy(..., group=cp, dp_group=dp)``, FSDP2's gradient
division turned off) gives exactly the gradients, parameters and loss of a plain single-process model trained on the
union of the DP replicas' batches with the ordinary mean cross-entropy over all valid tokens.

The reference is independent of cp_packing's attention and loss: HF's eager attention with an explicit
block-diagonal causal 4-D mask and per-segment position ids from a plain-Python segmentation
(``tests.maps.block_diagonal_causal``), and ``F.cross_entropy(..., reduction="mean")`` over every valid label of the union.

Also pinned: FSDP2's default gradient AVERAGE over its dp*cp ranks makes the gradients dp*cp times too small (the
reason the recipe turns it off), and the alternative (keep the average, multiply the loss by dp*cp) is exact too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import cp_packing  # noqa: E402
from cp_packing.hf import cp_model_inputs, register_cp_attention  # noqa: E402
from cp_packing.testing import run_distributed  # noqa: E402
from tests.maps import block_diagonal_causal  # noqa: E402

RTOL, ATOL = 1e-4, 1e-6
# AdamW's first step moves each weight by about lr * g / (|g| + eps): for a weight whose gradient is ~0, a 3e-8
# rounding difference in g would flip a sign-like update of size lr. eps = 1e-4 bounds the update's sensitivity to
# lr / eps = 10 (so 3e-8 -> 3e-7 < ATOL), while a wrong or missing update (~lr = 1e-3) is still a thousand times ATOL.
ADAMW = dict(lr=1e-3, eps=1e-4, weight_decay=0.01)
VOCAB = 64

# Two DP replicas' packed batches ([2, 16] each; T = 32, so cp=2 holds 16 tokens per rank). They differ in their
# number of valid labels (24 vs 19), so normalising each replica by its own count would give another loss than the
# mean over the union. Documents cross the cp=2 shard edge (flat position 16), rows start with the same index,
# there is a one-token document and padding.
DP_MAPS = (
    torch.tensor([
        [1] * 5 + [2] * 9 + [3] * 2,
        [1] * 3 + [2] * 13,
    ]),
    torch.tensor([
        [1] * 12 + [0] * 4,
        [1] * 1 + [2] * 6 + [3] * 6 + [0] * 3,
    ]),
)


def make_model(attn: str) -> torch.nn.Module:
    """Tiny random-init float32 Llama (GQA 4/2 heads, 2 layers); the same weights on every call."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()


def dp_batch(dp_rank: int) -> dict:
    """DP replica ``dp_rank``'s global ``[B, S]`` batch: doc map, input ids and globally shifted labels."""
    doc_ids = DP_MAPS[dp_rank]
    g = torch.Generator().manual_seed(100 + dp_rank)
    input_ids = torch.randint(0, VOCAB, doc_ids.shape, generator=g)
    labels = cp_packing.next_token_labels(input_ids, doc_ids)
    return {"input_ids": input_ids, "labels": labels, "doc_ids": doc_ids}


# ------------------------------------------------------------------------------------------------ the recipe


def fsdp2_step(dp: int, cp: int, variant: str) -> dict:
    """One training step of the docs/integration.md recipe on this rank (the code the docs show, plus checks).

    ``variant``: ``"recipe"`` (gradient division off), ``"mixed_bf16"`` (the recipe with FSDP2 mixed precision:
    bf16 compute, float32 gradient reduction), ``"scale_loss"`` (FSDP2's default average, loss x dp*cp) or
    ``"fsdp_default"`` (FSDP2's default average and the plain loss: the mistake the recipe avoids).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")

    mesh = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
    dp_cp_mesh = mesh["dp", "cp"]._flatten("dp_cp")  # CP ranks hold the same parameters: shard over dp*cp

    model = make_model(register_cp_attention()).to(device)
    fsdp_kwargs = {"mesh": dp_cp_mesh}
    if variant == "mixed_bf16":
        # the default cast_forward_inputs=True copies cp_sharded for every unit; the copies share its cache
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    if variant in ("recipe", "mixed_bf16"):
        for module in model.modules():  # every FSDP unit: the setting is per unit
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # SUM the gradients over dp*cp, do not average
                module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    batch = {k: v.to(device) for k, v in dp_batch(mesh.get_local_rank("dp")).items()}  # this replica's batch
    local, sharded = cp_packing.distribute_batch(batch, group=mesh["cp"], layout="balanced")
    logits = model(**cp_model_inputs(local, sharded, group=mesh["cp"])).logits[0]  # [T_local, V]
    loss = cp_packing.packed_cross_entropy(logits, local["labels"][0], group=mesh["cp"], dp_group=mesh["dp"])
    (loss * (dp * cp) if variant == "scale_loss" else loss).backward()
    logged = cp_packing.reduce_loss_for_logging(loss, group=mesh["cp"], dp_group=mesh["dp"])

    grads = {n: p.grad.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    is_dtensor = all(type(p).__name__ == "DTensor" for p in model.parameters())
    opt.step()
    opt.zero_grad()
    params = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    return {"grads": grads, "params": params, "loss": float(logged), "is_dtensor": is_dtensor, "dtype": logits.dtype,
            "fsdp_group_size": dp_cp_mesh.size(), "cp_size": sharded.cp_size, "T_local": sharded.num_local_tokens}


def _worker(rank: int, world_size: int, dp: int, cp: int, variants: tuple[str, ...]) -> dict:
    return {variant: fsdp2_step(dp, cp, variant) for variant in variants}


# ------------------------------------------------------------------------------------------------ the reference


def reference_step(dp: int) -> dict:
    """A plain single-process model, same init, one AdamW step on the union of the ``dp`` replicas' batches."""
    model = make_model("eager")
    batches = [dp_batch(r) for r in range(dp)]
    doc = torch.cat([b["doc_ids"] for b in batches])  # [dp*B, S]: rows are independent, the union is a bigger batch
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    T = doc.numel()
    mask, pos = block_diagonal_causal(doc)  # [1, 1, T, T], [1, T]
    logits = model(input_ids=ids.reshape(1, T), position_ids=pos, attention_mask=mask, use_cache=False).logits
    loss = F.cross_entropy(logits[0], labels.reshape(T), ignore_index=-100)  # mean over every valid label
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"grads": grads, "params": params, "loss": float(loss.detach()), "valid": int((labels != -100).sum())}


def assert_tensors_close(got: dict, expected: dict, what: str, scale: float = 1.0) -> None:
    assert got.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(got[n] * scale, expected[n], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=n: f"{what} {n}: {m}")


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("dp, cp", [(2, 2), (1, 2)])
def test_fsdp2_dp_cp_recipe_matches_single_process(dp, cp):
    variants = ("recipe", "scale_loss", "fsdp_default") if dp * cp == 4 else ("recipe", "mixed_bf16")
    results = run_distributed(_worker, dp * cp, dp, cp, variants)
    ref = reference_step(dp)
    if dp == 2:  # replicas with different valid counts: a per-replica normalisation would give another loss
        counts = [int((dp_batch(r)["labels"] != -100).sum()) for r in range(dp)]
        assert counts[0] != counts[1] and sum(counts) == ref["valid"]
    for res in results:  # one per rank (only this rank's under torchrun)
        step = res["recipe"]
        assert step["is_dtensor"] and step["fsdp_group_size"] == dp * cp  # really FSDP2-sharded over dp*cp
        assert step["cp_size"] == cp and step["T_local"] == DP_MAPS[0].numel() // cp
        assert_tensors_close(step["grads"], ref["grads"], "gradient")
        assert_tensors_close(step["params"], ref["params"], "parameter after AdamW")
        assert step["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=ATOL)
        if "scale_loss" in res:
            assert_tensors_close(res["scale_loss"]["grads"], ref["grads"], "gradient (loss x dp*cp)")
            assert_tensors_close(res["scale_loss"]["params"], ref["params"], "parameter (loss x dp*cp)")
            # FSDP2's default averages over dp*cp ranks: the gradients come out dp*cp times too small.
            default = res["fsdp_default"]["grads"]
            assert_tensors_close(default, ref["grads"], "gradient (FSDP2 default average) x dp*cp", scale=dp * cp)
            worst = max(float((default[n] - ref["grads"][n]).abs().max()) for n in ref["grads"])
            assert worst > 10 * ATOL
        if "mixed_bf16" in res:
            # bf16 parameters in forward/backward, float32 gradient reduction: within bf16 rounding of the reference.
            mixed = res["mixed_bf16"]
            assert mixed["dtype"] == torch.bfloat16
            assert mixed["loss"] == pytest.approx(ref["loss"], rel=5e-3)
            scale = max(float(g.abs().max()) for g in ref["grads"].values())
            worst = max(float((mixed["grads"][n] - ref["grads"][n]).abs().max()) for n in ref["grads"])
            assert worst <= 3e-2 * scale, (worst, scale)
