"""CPTrainer: HF's Trainer with context parallelism trains exactly like a one-process Trainer.

What a user relies on: on 2 ranks (cp 2) and 4 ranks (dp 2 x cp 2), with gradient accumulation 2 and 3 optimizer
steps, the logged loss of every step and the final weights equal those of a plain one-process ``transformers.Trainer``
on the same packed rows (same order), within float32 rounding.

The reference is independent of cp_packing: HF's sdpa attention with an explicit block-diagonal causal 4-D mask per
row and per-document position ids, HF's own loss on HF's unshifted labels (-100 at every document's first token and
on padding), all built here in plain Python; its micro-batch holds the rows of every DP replica, so an optimizer step
sees the same rows. Both runs use the Trainer's own sampler (accelerate's seedable random sampler, seeded by
``args.seed``): in CPTrainer split over the DP replicas, batch ``k`` of replica ``i`` being batch ``k * dp + i``, as
on ``dp`` plain processes.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments  # noqa: E402

from cp_packing.testing import run_distributed, synthetic_doc_ids  # noqa: E402
from cp_packing.trainer import cp_batch  # noqa: E402

HAS_TRL = importlib.util.find_spec("trl") is not None
VOCAB, SEQ, ROWS = 64, 24, 12
STEPS, ACCUM = 3, 2
# Plain SGD without clipping: the update is lr * gradient, so the final weights check the gradients' scale too
# (AdamW and clipping would hide a gradient off by a constant factor, e.g. DDP's average over the world); the
# pre-clipping gradient norm HF logs is compared as well (max_grad_norm far above it: it never clips).
OPTIM = dict(optim="sgd", learning_rate=0.1, weight_decay=0.0, max_grad_norm=1e9, ddp_find_unused_parameters=False)
RTOL, ATOL = 1e-4, 1e-6
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)


def make_model(attn: str) -> torch.nn.Module:
    """Tiny random-init float32 Llama; the same weights on every call. Each model gets its OWN config copy
    (transformers shares a config object between the models built from it)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation=attn).float()


def packed_rows() -> list[dict[str, torch.Tensor]]:
    """Neat-packed rows: documents of lognormal length (median 6), up to 25% tail padding; documents cross the
    cp=2 shard edge (position 12 of a row)."""
    doc = synthetic_doc_ids("lognormal", ROWS, SEQ, median=6, sigma=1.0, pad=0.25, seed=3)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(4))
    return [{"input_ids": ids[r], "doc_ids": doc[r]} for r in range(ROWS)]


def reference_row(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF inputs for one row, from a plain-Python segmentation: unshifted labels, positions, block-diagonal mask."""
    doc, ids = row["doc_ids"].tolist(), row["input_ids"].tolist()
    seg, pos, labels = [], [], []
    for s, d in enumerate(doc):
        new = s == 0 or d != doc[s - 1]
        seg.append(s if new else seg[-1])
        pos.append(0 if new else pos[-1] + 1)
        labels.append(-100 if new or d == 0 else ids[s])
    seg_t, t = torch.tensor(seg), torch.arange(len(doc))
    mask = (seg_t[:, None] == seg_t[None, :]) & (t[:, None] >= t[None, :])  # [S, S] True = attend
    return {"input_ids": row["input_ids"], "labels": torch.tensor(labels), "position_ids": torch.tensor(pos),
            "attention_mask": mask[None]}  # [1, S, S] -> collated [B, 1, S, S]


def training_args(out: str, batch_size: int, **extra) -> TrainingArguments:
    """Plain SGD, no clipping, STEPS steps of ACCUM micro-batches of ``batch_size`` rows; ``extra`` on top."""
    kwargs = dict(output_dir=out, per_device_train_batch_size=batch_size, gradient_accumulation_steps=ACCUM,
                  per_device_eval_batch_size=batch_size, max_steps=STEPS, logging_steps=1, lr_scheduler_type="constant",
                  save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
                  dataloader_pin_memory=False, **OPTIM)
    return TrainingArguments(**{**kwargs, **extra})


def use_world_env(rank: int, world: int) -> None:
    """What torchrun would set, for accelerate's state in a run_ranks rank (the gloo group already exists).

    OMP_NUM_THREADS=1: otherwise accelerate raises the rank's intra-op threads to the physical cores, and an OpenMP
    parallel region in a process forked from a parent that used OpenMP can hang (seen in TRL's collator)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                      HF_HUB_DISABLE_TELEMETRY="1")
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()


def enable_fsdp_on_cpu() -> None:
    """Let accelerate set up FSDP on CPU gloo (after :func:`use_world_env`; the TrainingArguments then need
    ``accelerator_config={"use_configured_state": True}`` so that they keep this state).

    accelerate 1.15 enables FSDP only for accelerator distributed types (``AcceleratorState.__init__``,
    accelerate/state.py: the ``elif self.distributed_type in [DistributedType.MULTI_GPU, ...]`` branch that sets
    ``DistributedType.FSDP``); on ``MULTI_CPU`` it drops the plugin and the Trainer uses DDP. Here the process state
    is built for CPU (gloo, device cpu) and then labelled MULTI_GPU, so that branch runs: the rest (accelerate's
    ``fsdp2_prepare_model`` -> ``fully_shard`` over the world, its ``no_sync`` under gradient accumulation, its
    gradient clipping, the Trainer's FSDP paths) is the code a GPU run goes through."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    assert state.distributed_type == DistributedType.MULTI_CPU and state.device.type == "cpu"
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def losses_and_weights(trainer: Trainer) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """The (loss, gradient norm) HF logged at every optimizer step, and the final weights (FSDP2's sharded
    parameters gathered to full tensors: a collective, every rank calls it)."""
    logged = [(entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history if "loss" in entry]
    weights = {}
    for k, v in trainer.model.state_dict().items():
        if isinstance(v, torch.distributed.tensor.DTensor):
            v = v.full_tensor()
        weights[k] = v.detach().clone()
    return logged, weights


EVAL_ROWS = 4  # a multiple of every DP size here: no global eval batch holds a repeated row


def _train_and_evaluate(trainer: Trainer, eval_rows: list) -> tuple:
    trainer.train()
    return (*losses_and_weights(trainer), trainer.evaluate(eval_rows)["eval_loss"])


def _reference(rank: int, world: int, dp_sizes: tuple[int, ...]):
    """One process: the plain Trainer for each DP size (its micro-batch = every replica's rows)."""
    results = {}
    for dp in dp_sizes:
        use_world_env(0, 1)
        with tempfile.TemporaryDirectory() as out:
            trainer = Trainer(model=make_model("sdpa"), args=training_args(out, dp),
                              train_dataset=[reference_row(r) for r in packed_rows()])
            results[dp] = _train_and_evaluate(trainer, [reference_row(r) for r in packed_rows()[:EVAL_ROWS]])
    return results


def _plain_ddp(rank: int, world: int):
    """The plain Trainer on ``world`` DDP processes with ``average_tokens_across_devices=False``: each process's loss
    is its own batch's mean, DDP averages them (the reference of CPTrainer's DP replicas without token averaging)."""
    use_world_env(rank, world)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model=make_model("sdpa"), args=training_args(out, 1, average_tokens_across_devices=False),
                          train_dataset=[reference_row(r) for r in packed_rows()])
        return _train_and_evaluate(trainer, [reference_row(r) for r in packed_rows()[:EVAL_ROWS]])


def _cp_run(rank: int, world: int, cp: int, layout: str, mode: str):
    """``mode``: "ddp"; "fsdp2" (FSDP2 through accelerate: fully_shard over the whole DP x CP world);
    "fsdp2_on_cpu" (FSDP2 asked for, which accelerate drops on CPU: a warning, and DDP); "ddp_replica_mean" (DDP,
    ``average_tokens_across_devices=False``); "ddp_full_logits" (DDP, ``chunked_loss=False``: the loss on the model's
    logits; every other mode uses the default chunked loss, which never builds them)."""
    from cp_packing.groups import CPMesh
    from cp_packing.hf import CPTrainer

    use_world_env(rank, world)
    fsdp = mode == "fsdp2"
    with tempfile.TemporaryDirectory() as out:
        args = training_args(out, 1)
        if mode == "fsdp2":
            enable_fsdp_on_cpu()
            args = training_args(out, 1, fsdp=True, fsdp_config={"version": 2},
                                 accelerator_config={"use_configured_state": True})
        elif mode == "fsdp2_on_cpu":
            args = training_args(out, 1, fsdp=True, fsdp_config={"version": 2})
        elif mode == "ddp_replica_mean":
            args = training_args(out, 1, average_tokens_across_devices=False)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("cp_packing").addHandler(handler)
        try:
            trainer = CPTrainer(model=make_model("sdpa"), args=args, train_dataset=packed_rows(), cp_size=cp,
                                layout=layout, chunked_loss=mode != "ddp_full_logits")  # an sdpa model: switched
        finally:
            logging.getLogger("cp_packing").removeHandler(handler)
        assert trainer.accelerator.is_fsdp2 == fsdp
        mesh = trainer.cp_mesh  # the library's one mesh type
        assert isinstance(mesh, CPMesh) and (mesh.dp_size, mesh.cp_size, mesh.global_rank) == (world // cp, cp, rank)
        dropped = [r for r in records if "FSDP was requested" in r.getMessage()]
        assert len(dropped) == (mode == "fsdp2_on_cpu"), [r.getMessage() for r in records]
        result = _train_and_evaluate(trainer, packed_rows()[:EVAL_ROWS])
        chunked = mode != "ddp_full_logits"
        assert (trainer.cp_projection is not None) == chunked
        if not fsdp:  # the chunked loss's model call built no logits: [1, 0, V]
            with torch.no_grad():
                batch = next(iter(trainer.get_train_dataloader()))
                _, outputs = trainer.compute_loss(trainer.model_wrapped, batch, return_outputs=True)
            assert outputs.logits.shape[1] == (0 if chunked else batch["input_ids"].numel() // cp)
        wrapper = torch.distributed.fsdp.FSDPModule if fsdp else torch.nn.parallel.DistributedDataParallel
        assert isinstance(trainer.model_wrapped, wrapper), type(trainer.model_wrapped)
        if fsdp:  # FSDP2 with a custom gradient divisor: CPTrainer's factor would be wrong, so it refuses
            assert trainer._gradient_average_factor(trainer.model) == world
            for module in trainer.model.modules():  # the root holds no parameters: set it on every sharded module
                if isinstance(module, torch.distributed.fsdp.FSDPModule):
                    module.set_gradient_divide_factor(1.0)
            with pytest.raises(NotImplementedError, match="set_gradient_divide_factor"):
                trainer.compute_loss(trainer.model, next(iter(trainer.get_train_dataloader())))
        return result


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.distributed
def test_cp_trainer_equals_one_process_trainer():
    """cp 2 (layout balanced; FSDP2 asked for, which accelerate drops on CPU: DDP) and dp 2 x cp 2 (layout zigzag:
    documents padded in the collator) under DDP and under FSDP2 through accelerate, against the plain Trainer: the
    loss and gradient norm of every step, the final weights and the eval loss after training. dp 2 x cp 2 without
    token averaging (``average_tokens_across_devices=False``: each replica's own mean) against the plain Trainer on
    2 DDP processes. The chunked loss (the default) and the loss on the logits (``chunked_loss=False``) at cp 2 both
    equal the reference, so each other. One test, so the references run once (pytest-xdist would run a shared
    fixture in every worker)."""
    cp = 2
    reference = run_distributed(_reference, 1, (1, 2))[0]
    reference["replica_mean"] = run_distributed(_plain_ddp, 2)[0]
    init = make_model("sdpa").state_dict()
    runs = ((2, "balanced", "fsdp2_on_cpu"), (2, "balanced", "ddp_full_logits"), (4, "zigzag", "ddp"),
            (4, "zigzag", "fsdp2"), (4, "zigzag", "ddp_replica_mean"))
    for world, layout, mode in runs:
        ref_logged, ref_weights, ref_eval = reference["replica_mean" if mode == "ddp_replica_mean" else world // cp]
        results = run_distributed(_cp_run, world, cp, layout, mode)
        run = f"world {world} {mode}"
        for rank, (logged, weights, eval_loss) in enumerate(results):
            assert len(logged) == STEPS == len(ref_logged)
            assert weights.keys() == ref_weights.keys()
            torch.testing.assert_close(torch.tensor(logged), torch.tensor(ref_logged), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{run} rank {rank}, (loss, grad norm) per step: {m}")
            for name, w in weights.items():
                torch.testing.assert_close(w, ref_weights[name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{run} rank {rank} {name}: {m}")
            assert eval_loss == pytest.approx(ref_eval, rel=1e-5), f"{run} rank {rank}: eval loss"
        # the run trained: weights moved by far more than the tolerance
        assert _max_diff(ref_weights, init) > 100 * ATOL
        print(f"{run} ({layout}): max loss diff "
              f"{max(abs(a[0] - b[0]) for a, b in zip(results[0][0], ref_logged)):.3g}, grad norm diff "
              f"{max(abs(a[1] - b[1]) for a, b in zip(results[0][0], ref_logged)):.3g}, "
              f"max weight diff {max(_max_diff(r[1], ref_weights) for r in results):.3g}, "
              f"eval loss diff {max(abs(r[2] - ref_eval) for r in results):.3g}")
    # without token averaging the loss is another one: the replica-mean run checks something of its own
    assert abs(reference["replica_mean"][0][0][0] - reference[2][0][0][0]) > 1e-4


# ------------------------------------------------------------------------------------------------ cp_batch


def test_cp_batch_from_position_ids_and_hf_labels():
    """TRL padding-free batch: position_ids restart per document, HF labels (unshifted, prompt-masked)."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    batch = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
             "labels": torch.tensor([[-100, -100, 7, 8, -100, 10, 11]])}  # prompt 5, 6 masked in document 1
    out = cp_batch(batch, cp_size=2, layout="contiguous")
    assert out["doc_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 0]]
    # target at t is the label at t+1 inside the document; the last token of each document and padding get -100
    assert out["shift_labels"].tolist() == [[-100, 7, 8, -100, 10, 11, -100, -100]]
    assert out["input_ids"].shape == (1, 8)


def test_cp_batch_refuses_labels_shifted_already():
    ids = torch.tensor([[5, 6, 7, 8]])
    doc = torch.tensor([[1, 1, 1, 1]])
    shifted = torch.tensor([[6, 7, 8, -100]])
    with pytest.raises(ValueError, match="shift_labels"):
        cp_batch({"input_ids": ids, "doc_ids": doc, "labels": shifted})
    out = cp_batch({"input_ids": ids, "doc_ids": doc, "shift_labels": shifted})
    assert out["shift_labels"].tolist() == shifted.tolist()


def test_cp_batch_refuses_unshifted_labels_as_shift_labels():
    """HF's unshifted labels passed as ``shift_labels`` (a valid label on a document's last token, where a shifted
    label would be the next document's first): a ValueError naming 'labels', not a model trained to copy its input;
    prompt-masked or not."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 4]])
    doc = torch.tensor([[1, 1, 1, 2, 2, 0]])
    for unshifted in ([[5, 6, 7, 8, 9, -100]], [[-100, 6, 7, -100, 9, -100]]):
        with pytest.raises(ValueError, match=r"shift_labels.*\[0, 2\].*go under 'labels'"):
            cp_batch({"input_ids": ids, "doc_ids": doc, "shift_labels": torch.tensor(unshifted)})
        out = cp_batch({"input_ids": ids, "doc_ids": doc, "labels": torch.tensor(unshifted)})  # the right key
        assert out["shift_labels"].tolist() == [[6, 7, -100, 9, -100, -100]]


def test_trainer_mesh_is_the_groups_mesh():
    """The trainer's mesh is the library's one mesh type (``cp_packing.trainer.CPMesh`` is an alias)."""
    from cp_packing import groups, trainer

    assert trainer.CPMesh is groups.CPMesh
    assert groups.CPMesh.from_world(1) == groups.CPMesh.from_ints()
    with pytest.raises(ValueError, match="cp_size=2 needs a process group"):
        groups.CPMesh.from_world(2)


def test_cp_batch_zigzag_pads_every_document():
    out = cp_batch({"input_ids": torch.arange(6)[None], "doc_ids": torch.tensor([[1, 1, 1, 2, 2, 0]])}, cp_size=2,
                   layout="zigzag")
    runs = torch.unique_consecutive(out["doc_ids"][0], return_counts=True)[1]
    assert all(int(n) % 4 == 0 for n in runs)
    valid = out["shift_labels"][out["shift_labels"] != -100].tolist()
    assert valid == [1, 2, 4]  # the same targets as without padding


# ------------------------------------------------------------------------------------------------- TRL SFTTrainer

TRL_STEPS = 2


def _tiny_tokenizer():
    """A word-level tokenizer over VOCAB tokens, built here (nothing downloaded); TRL needs a pad token."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>")


def _documents():
    """Tokenized documents of 3..15 tokens, for TRL's best-fit-decreasing packer (packing=True, max_length=SEQ)."""
    import datasets

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 16, (20,), generator=g).tolist()
    return datasets.Dataset.from_dict({"input_ids": [torch.randint(2, VOCAB, (n,), generator=g).tolist()
                                                     for n in lengths]})


def _sft_args(out: str, batch_size: int, **extra):
    from trl import SFTConfig

    kwargs = dict(output_dir=out, per_device_train_batch_size=batch_size, gradient_accumulation_steps=ACCUM,
                  max_steps=TRL_STEPS, logging_steps=1, lr_scheduler_type="constant", save_strategy="no",
                  report_to="none", disable_tqdm=True, use_cpu=True, seed=0, dataloader_pin_memory=False,
                  packing=True, max_length=SEQ, bf16=False, **OPTIM)  # SFTConfig's default is bf16=True
    return SFTConfig(**{**kwargs, **extra})


def _sft_run(rank: int, world: int, cp: int):
    from trl import SFTTrainer

    from cp_packing.trainer import CPSFTTrainer

    use_world_env(rank, world)
    with tempfile.TemporaryDirectory() as out:
        if cp == 0:  # the reference: TRL's own padding-free path, one process
            trainer = SFTTrainer(model=make_model("sdpa"), args=_sft_args(out, 1), train_dataset=_documents(),
                                 processing_class=_tiny_tokenizer())
        else:
            trainer = CPSFTTrainer(model=make_model("sdpa"), args=_sft_args(out, 1), train_dataset=_documents(),
                                   processing_class=_tiny_tokenizer(), cp_size=cp)
        trainer.train()
    return losses_and_weights(trainer)


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_TRL, reason="needs trl")
def test_cp_sft_trainer_equals_trl_sft_trainer():
    """TRL's packing (best-fit decreasing) and padding-free collator ([1, T] rows, position_ids restarting per
    document): CPSFTTrainer at cp 2 gives TRL's own one-process SFTTrainer's losses and weights (HF sdpa, which
    finds the documents from the position ids; TRL's default gradient checkpointing on in both)."""
    (ref_logged, ref_weights), = run_distributed(_sft_run, 1, 0)
    for logged, weights in run_distributed(_sft_run, 2, 2):
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(ref_logged), rtol=1e-5, atol=0)
        for name, w in weights.items():
            torch.testing.assert_close(w, ref_weights[name], rtol=RTOL, atol=ATOL, msg=name)
