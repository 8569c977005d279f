"""Every TrainingArguments / SFTConfig field that changes the math: honoured by CPTrainer / CPSFTTrainer, or refused
at construction with a ValueError that names it.

What a user relies on: with a field set, CPTrainer at cp 2 (gloo, 2 ranks) logs the same loss and gradient norm at
every step, ends with the same weights, logs the same eval metrics, counts the same input tokens and predicts the
same logits as a plain one-process ``transformers.Trainer`` (or TRL ``SFTTrainer``) with that field set, on the same
rows; or it raises at construction naming the field (docs/trainer.md has the table of every field).

The reference is the one of tests/test_trainer.py (HF sdpa with a block-diagonal 4-D mask per row, HF's own loss and
label smoother on HF labels; TRL's own padding-free path), so it shares none of cp_packing's code. Every case runs
in ONE call per side (the CP ranks loop over the cases, so does the reference process), cached for the module.
"""

from __future__ import annotations

import copy
import functools
import tempfile
import traceback

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import Trainer  # noqa: E402

from cp_packing.testing import run_distributed  # noqa: E402
from tests.test_trainer import (  # noqa: E402
    ACCUM,
    ATOL,
    HAS_TRL,
    RTOL,
    SEQ,
    STEPS,
    TRL_STEPS,
    VOCAB,
    _sft_args,
    _tiny_tokenizer,
    losses_and_weights,
    make_model,
    packed_rows,
    reference_row,
    training_args,
    use_world_env,
)

CP = 2
TIMEOUT = 180.0  # every case of one side (a hang in a collective is killed and reported)
EVAL_ROWS = 5  # eval batch 2: the last batch holds one row (the Trainer's remainder handling)


def focal_loss(outputs, labels, num_items_in_batch=None, shift_labels=None):
    """A compute_loss_func that is not the cross-entropy (so ignoring it shows): sum of ce * (1 - p)^2 / N. It takes
    ``shift_labels``, which makes it CP-aware: the plain Trainer passes HF's unshifted ``labels`` (shifted here),
    CPTrainer this rank's labels already shifted on the global stream."""
    logits = outputs.logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
                         ignore_index=-100, reduction="none")
    return (ce * (1 - torch.exp(-ce)) ** 2).sum() / num_items_in_batch


def hf_style_loss(outputs, labels, num_items_in_batch=None):
    """HF's documented compute_loss_func signature: it would shift labels itself (on a shard under CP)."""
    return focal_loss(outputs, labels, num_items_in_batch)


def token_accuracy(prediction):
    """compute_metrics: next-token accuracy over the valid HF labels (makes evaluate gather the logits)."""
    logits, labels = prediction.predictions, prediction.label_ids
    hit, valid = logits[:, :-1].argmax(-1) == labels[:, 1:], labels[:, 1:] != -100
    return {"accuracy": float(hit[valid].mean())}


# name -> (TrainingArguments extras, trainer extras); parity with the plain one-process Trainer
HONOURED = {
    "train_sampling_strategy=sequential": ({"train_sampling_strategy": "sequential"}, {}),
    "train_sampling_strategy=group_by_length": ({"train_sampling_strategy": "group_by_length"}, {}),
    "train_sampling_strategy=batch_rebalance": ({"train_sampling_strategy": "batch_rebalance"}, {}),
    "data_seed": ({"data_seed": 7}, {}),
    "label_smoothing_factor": ({"label_smoothing_factor": 0.1}, {}),
    "compute_loss_func": ({}, {"compute_loss_func": focal_loss}),
    "eval_strategy=steps": ({"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 2,
                             "label_smoothing_factor": 0.1}, {"compute_metrics": token_accuracy}),
    "gradient_checkpointing": ({"gradient_checkpointing": True}, {}),
    "include_num_input_tokens_seen": ({"include_num_input_tokens_seen": "all"}, {}),
    "average_tokens_across_devices=False": ({"average_tokens_across_devices": False}, {}),
    "max_grad_norm": ({"max_grad_norm": 0.05}, {}),
}
# name -> (TrainingArguments extras, trainer extras, the field the error names); refused at construction
REFUSED = {
    "torch_compile": ({"torch_compile": True}, {}, "torch_compile"),
    "neftune_noise_alpha": ({"neftune_noise_alpha": 5.0}, {}, "neftune_noise_alpha"),
    "use_liger_kernel": ({"use_liger_kernel": True}, {}, "use_liger_kernel"),
    "optim=lomo": ({"optim": "lomo"}, {}, "optim"),
    "optim=galore_adamw_layerwise": ({"optim": "galore_adamw_layerwise", "optim_target_modules": ["q_proj"]}, {},
                                     "optim"),
    "label_names": ({"label_names": ["targets"]}, {}, "label_names"),
    "accelerator_config.dispatch_batches": ({"accelerator_config": {"dispatch_batches": True}}, {},
                                            "dispatch_batches"),
    "compute_loss_func without shift_labels": ({}, {"compute_loss_func": hf_style_loss}, "compute_loss_func"),
    "MoE output_router_logits": ({}, {"model": "moe"}, "router_aux_loss_coef"),
}


def _moe_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                           output_router_logits=True)
    return MixtralForCausalLM(copy.deepcopy(config))


def _eval_rows(cp: bool) -> list[dict[str, torch.Tensor]]:
    """The eval rows: packed rows with HF labels for CPTrainer (doc_ids), the 4-D-mask rows for the reference."""
    rows = packed_rows()[:EVAL_ROWS]
    if not cp:
        return [reference_row(r) for r in rows]
    return [{**r, "labels": reference_row(r)["labels"]} for r in rows]


def _train(cp: bool, extra_args: dict, extra: dict) -> dict:
    """One training run (CPTrainer on this rank, or the reference) and what it logged, counted and predicted."""
    from cp_packing.trainer import CPTrainer

    extra = dict(extra)
    model = _moe_model() if extra.pop("model", None) == "moe" else make_model("sdpa")
    evaluating = "eval_strategy" in extra_args
    if evaluating:
        extra["eval_dataset"] = _eval_rows(cp)
    rows = packed_rows() if cp else [reference_row(r) for r in packed_rows()]
    with tempfile.TemporaryDirectory() as out:
        args = training_args(out, 1, **extra_args)
        if cp:
            trainer = CPTrainer(model=model, args=args, train_dataset=rows, cp_size=CP,
                                layout="zigzag" if evaluating else "balanced", **extra)
        else:
            trainer = Trainer(model=model, args=args, train_dataset=rows, **extra)
        trainer.train()
        logged, weights = losses_and_weights(trainer)
        result = {"logged": logged, "weights": weights, "tokens": trainer.state.num_input_tokens_seen,
                  "evals": [(e["eval_loss"], e["eval_accuracy"]) for e in trainer.state.log_history
                            if "eval_loss" in e]}
        if evaluating:
            metrics = trainer.evaluate()
            result["final_eval"] = (metrics["eval_loss"], metrics["eval_accuracy"])
            pred = trainer.predict(_eval_rows(cp))
            result["predictions"], result["label_ids"] = pred.predictions, pred.label_ids
    return result


def _construct(extra_args: dict, extra: dict) -> str:
    """Build a CPTrainer with a refused setting: the error's message (or a note that none came)."""
    from cp_packing.trainer import CPTrainer

    extra = dict(extra)
    model = _moe_model() if extra.pop("model", None) == "moe" else make_model("sdpa")
    with tempfile.TemporaryDirectory() as out:
        try:
            CPTrainer(model=model, args=training_args(out, 1, **extra_args), train_dataset=packed_rows(), cp_size=CP,
                      **extra)
        except ValueError as exc:
            return str(exc)
    return "no error"


def _isolated(run, *args) -> dict | str:
    """``run(*args)``, or the error's traceback (so one case's failure leaves the others' results)."""
    try:
        return run(*args)
    except Exception:  # noqa: BLE001 - reported by the case's test
        return traceback.format_exc()


def _cases(rank: int, world: int, cp: bool) -> dict:
    use_world_env(rank, world)
    results = {name: _isolated(_train, cp, *case) for name, case in HONOURED.items()}
    if cp:
        results.update({name: _construct(args, extra) for name, (args, extra, _) in REFUSED.items()})
    return results


@functools.lru_cache(maxsize=None)
def _trainer_results() -> tuple[dict, list[dict]]:
    """Every case once: the reference in one process, CPTrainer on 2 ranks (cp 2)."""
    reference = run_distributed(_cases, 1, False, timeout=TIMEOUT)[0]
    return reference, run_distributed(_cases, CP, True, timeout=TIMEOUT)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(HONOURED))
def test_field_is_honoured(name):
    reference, ranks = _trainer_results()
    ref = reference[name]
    assert isinstance(ref, dict), ref
    for rank, got in enumerate(ranks):
        got = got[name]
        where = f"{name}, rank {rank}"
        assert isinstance(got, dict), f"{where}: {got}"
        torch.testing.assert_close(torch.tensor(got["logged"]), torch.tensor(ref["logged"]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{where}, (loss, grad norm) per step: {m}")
        for key, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][key], w, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{where} {key}: {m}")
        assert got["tokens"] == ref["tokens"], where
        torch.testing.assert_close(torch.tensor(got["evals"]), torch.tensor(ref["evals"]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{where}, (eval loss, accuracy) per evaluation: {m}")
    got = ranks[0][name]
    print(f"{name}: max loss diff {max(abs(a[0] - b[0]) for a, b in zip(got['logged'], ref['logged'])):.3g}, "
          f"grad norm diff {max(abs(a[1] - b[1]) for a, b in zip(got['logged'], ref['logged'])):.3g}, weight diff "
          f"{max(float((got['weights'][k] - w).abs().max()) for k, w in ref['weights'].items()):.3g}")
    if name == "include_num_input_tokens_seen":
        assert ref["tokens"] == STEPS * ACCUM * SEQ  # one-row micro-batches
    if name == "eval_strategy=steps":
        assert len(ref["evals"]) == 2  # the evaluation at step 2, then evaluate() after training


@pytest.mark.distributed
def test_evaluate_and_predict_equal_one_process_trainer():
    """``evaluate()`` and ``predict()`` after training (layout zigzag: every document padded, the logits laid back):
    the eval loss and accuracy, the predicted logits of every real token and the label ids equal the one-process
    Trainer's; padding tokens' logits are 0."""
    reference, ranks = _trainer_results()
    ref = reference["eval_strategy=steps"]
    real = torch.stack([r["doc_ids"] for r in packed_rows()[:EVAL_ROWS]]) != 0  # [N, S]
    assert isinstance(ref, dict), ref
    for rank, got in enumerate(ranks):
        got = got["eval_strategy=steps"]
        assert isinstance(got, dict), f"rank {rank}: {got}"
        assert got["final_eval"] == pytest.approx(ref["final_eval"], rel=1e-5), rank
        predictions, expected = torch.as_tensor(got["predictions"]), torch.as_tensor(ref["predictions"])
        assert predictions.shape == expected.shape == (EVAL_ROWS, SEQ, VOCAB)
        torch.testing.assert_close(predictions[real], expected[real], rtol=1e-4, atol=1e-5)
        assert bool((predictions[~real] == 0).all())
        assert (got["label_ids"] == ref["label_ids"]).all()
        print(f"rank {rank}: eval loss diff {abs(got['final_eval'][0] - ref['final_eval'][0]):.3g}, max logit diff "
              f"{float((predictions[real] - expected[real]).abs().max()):.3g}")


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_field_is_refused_at_construction(name):
    field = REFUSED[name][2]
    for rank, message in enumerate(_trainer_results()[1]):
        assert field in message[name] and "is not supported under context parallelism" in message[name], \
            f"rank {rank}: {message[name]}"


# ------------------------------------------------------------------------------------------------- TRL SFTTrainer

def _sft_documents(mask: str | None = None):
    """Tokenized documents of 3..15 tokens (as tests/test_trainer.py), with a loss mask column where asked
    (``completion_mask`` / ``assistant_masks``: the first third of each document masked)."""
    import datasets

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 16, (20,), generator=g).tolist()
    columns = {"input_ids": [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]}
    if mask is not None:
        columns[mask] = [[0] * (n // 3) + [1] * (n - n // 3) for n in lengths]
    return datasets.Dataset.from_dict(columns)


SFT_HONOURED = {  # name -> (SFTConfig extras, dataset mask column, with an eval dataset)
    "packing=False": ({"packing": False, "per_device_train_batch_size": 2}, None, False),
    "padding_free": ({"packing": False, "padding_free": True, "max_length": None, "per_device_train_batch_size": 2},
                     None, False),
    "completion_only_loss": ({"completion_only_loss": True}, "completion_mask", False),
    "assistant masks": ({}, "assistant_masks", False),
    "label_smoothing_factor": ({"label_smoothing_factor": 0.1}, None, False),
    "eval_strategy=steps": ({"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 1}, None, True),
}
SFT_REFUSED = {"loss_type=dft": ({"loss_type": "dft"}, "loss_type"),
               "use_liger_kernel": ({"use_liger_kernel": True}, "use_liger_kernel")}


def _sft_cases(rank: int, world: int, cp: bool) -> dict:
    use_world_env(rank, world)
    results = {}
    cases = {**SFT_HONOURED, **({name: (args, None, False) for name, (args, _) in SFT_REFUSED.items()} if cp else {})}
    for name, (extra, mask, evaluating) in cases.items():
        with tempfile.TemporaryDirectory() as out:
            kwargs = dict(model=make_model("sdpa"), args=_sft_args(out, 1, **extra), train_dataset=_sft_documents(mask),
                          processing_class=_tiny_tokenizer())
            if evaluating:
                kwargs["eval_dataset"] = _sft_documents().select(range(6))
            results[name] = _isolated(_sft_train, kwargs, cp)
    return results


def _sft_train(kwargs: dict, cp: bool) -> dict | str:
    """One SFT run: what it logged (or the ValueError's message, for a refused field)."""
    from trl import SFTTrainer

    from cp_packing.trainer import CPSFTTrainer

    try:
        trainer = CPSFTTrainer(**kwargs, cp_size=CP) if cp else SFTTrainer(**kwargs)
    except ValueError as exc:
        return str(exc)
    trainer.train()
    logged, weights = losses_and_weights(trainer)
    return {"logged": logged, "weights": weights,
            "evals": [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]}


@functools.lru_cache(maxsize=None)
def _sft_results() -> tuple[dict, list[dict]]:
    return (run_distributed(_sft_cases, 1, False, timeout=TIMEOUT)[0],
            run_distributed(_sft_cases, CP, True, timeout=TIMEOUT))


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_TRL, reason="needs trl")
@pytest.mark.parametrize("name", sorted(SFT_HONOURED))
def test_sft_field_is_honoured(name):
    """CPSFTTrainer at cp 2 against TRL's own one-process SFTTrainer with the same SFTConfig field."""
    reference, ranks = _sft_results()
    ref = reference[name]
    for rank, got in enumerate(ranks):
        got = got[name]
        assert isinstance(ref, dict) and isinstance(got, dict), f"{name}, rank {rank}: {got} / reference: {ref}"
        torch.testing.assert_close(torch.tensor(got["logged"]), torch.tensor(ref["logged"]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{name}, rank {rank}, (loss, grad norm) per step: {m}")
        for key, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][key], w, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} {key}: {m}")
        torch.testing.assert_close(torch.tensor(got["evals"]), torch.tensor(ref["evals"]), rtol=1e-5, atol=0)
    assert len(ref["evals"]) == (TRL_STEPS if SFT_HONOURED[name][2] else 0)


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_TRL, reason="needs trl")
@pytest.mark.parametrize("name", sorted(SFT_REFUSED))
def test_sft_field_is_refused_at_construction(name):
    field = SFT_REFUSED[name][1]
    for rank, message in enumerate(_sft_results()[1]):
        assert isinstance(message[name], str) and field in message[name], f"rank {rank}: {message[name]}"
