"""Guards on the HF paths that used to train silently wrong (issue 11): each raises before a wrong number exists.

- A model called with ``cp_sharded`` whose attention is not cp_packing's (the shared-config switch: building a second
  model from the same config object with ``attn_implementation="sdpa"`` switches the first one too).
- HF's built-in loss (``labels=``) together with ``cp_sharded``: it would shift labels on the local shard.

Single process (cp_size 1 with a ``PackedSeqParams``): the guards are local checks, no communication.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from cp_packing import next_token_labels, packed_seq_params_from_doc_ids  # noqa: E402
from cp_packing.hf import check_cp_model, cp_model_inputs, register_cp_attention  # noqa: E402

NAME = register_cp_attention()
DOC = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]])
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 0]])


def config() -> LlamaConfig:
    return LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=32)


def model_from(cfg: LlamaConfig, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()


def test_shared_config_switch_is_refused():
    cfg = config()
    model = model_from(cfg, NAME)
    params = packed_seq_params_from_doc_ids(DOC)
    guarded = model(**cp_model_inputs(IDS, params, model=model)).logits  # guards installed, attention is cp's
    model_from(cfg, "sdpa")  # the trap: the SAME config object, now switched to sdpa for both models
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"deepcopy\(config\)"):  # the static check
        cp_model_inputs(IDS, params, model=model)
    with pytest.raises(ValueError, match=r"'sdpa', not cp_packing's"):  # a call without model=: the installed hook
        model(**cp_model_inputs(IDS, params))
    # the fix: each model its own config copy; the CP model is unaffected and gives the same logits as before
    fixed = model_from(copy.deepcopy(config()), NAME)
    model_from(copy.deepcopy(fixed.config), "sdpa")
    torch.testing.assert_close(fixed(**cp_model_inputs(IDS, params, model=fixed)).logits, guarded)


def test_layers_that_do_not_run_cp_attention_are_caught_after_the_forward():
    """The config says cp_packing but the layers read another config (as in composite models): no CP attention
    runs; the forward hook raises instead of returning the logits."""
    model = model_from(config(), NAME)
    params = packed_seq_params_from_doc_ids(DOC)
    check_cp_model(model)
    sdpa_config = copy.deepcopy(model.config)
    sdpa_config._attn_implementation = "sdpa"
    for layer in model.model.layers:
        layer.self_attn.config = sdpa_config
    with pytest.raises(ValueError, match="none of its attention layers ran cp_packing's attention"):
        model(**cp_model_inputs(IDS, params, model=model))


def test_hf_builtin_loss_with_cp_sharded_is_refused():
    model = model_from(config(), NAME)
    params = packed_seq_params_from_doc_ids(DOC)
    labels = next_token_labels(IDS, DOC).reshape(1, -1)
    with pytest.raises(ValueError, match="packed_cross_entropy"):
        model(**cp_model_inputs(IDS, params, model=model), labels=labels)
    with pytest.raises(ValueError, match="labels="):  # also once guarded, without model= in this call
        model(**cp_model_inputs(IDS, params), labels=labels)


def test_guard_is_idempotent_and_unwraps():
    model = model_from(config(), NAME)
    check_cp_model(model)
    check_cp_model(torch.nn.Sequential(model)[0])
    wrapper = torch.nn.Module()
    wrapper.module = model  # a DDP-like wrapper
    check_cp_model(wrapper)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    with pytest.raises(TypeError, match="torch.nn.Module"):
        check_cp_model("model")


def test_model_windows_reads_the_layer_kinds_of_real_configs():
    """The per-layer windows the launcher and CPTrainer plan with come from the model's own config."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    from cp_packing.hf import model_windows

    assert model_windows(LlamaConfig(num_hidden_layers=2)) is None
    assert model_windows(MistralConfig(num_hidden_layers=2, sliding_window=64)) == 64
    assert model_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) is None
    gemma = Gemma2Config(num_hidden_layers=4, sliding_window=32)
    assert model_windows(gemma) == tuple(32 if t == "sliding_attention" else None for t in gemma.layer_types)
    assert set(model_windows(gemma)) == {32, None}
    qwen = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert model_windows(qwen) == tuple(16 if t == "sliding_attention" else None for t in qwen.layer_types)
    assert model_windows(Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=16)) is None
    wrapper = torch.nn.Module()
    wrapper.module = AutoModelForCausalLM.from_config(MistralConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=32, sliding_window=8))
    assert model_windows(wrapper) == 8  # a model (through a DDP-style .module wrapper) reads its config


def _one_rank_dropout(rank, world):
    import time

    import torch.distributed as dist

    from cp_packing import agreement, distribute_batch

    agreement.set_agreement_timeout(30)
    torch.manual_seed(0)
    cfg = config()
    if rank == 0:
        cfg.attention_dropout = 0.1  # the HF wrapper refuses dropout: on this rank only
    model = model_from(cfg, register_cp_attention()).train()
    doc = torch.tensor([[1] * 12 + [2] * 4])
    ids = torch.randint(0, cfg.vocab_size, doc.shape)
    local, sharded = distribute_batch({"input_ids": ids, "doc_ids": doc}, group=dist.group.WORLD, layout="contiguous")
    t0 = time.monotonic()
    try:
        model(**cp_model_inputs(local, sharded, group=dist.group.WORLD))  # no model=: the wrapper's own refusal
    except ValueError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


@pytest.mark.distributed
def test_a_one_rank_refusal_in_the_hf_wrapper_raises_on_every_rank_within_seconds():
    """attention_dropout on one rank only: that rank's wrapper refuses it at the first layer, and the step's one
    agreement raises it on every rank (before, the other rank waited in gloo until the process group's timeout)."""
    from cp_packing.testing import run_distributed

    results = run_distributed(_one_rank_dropout, 2, timeout=60)
    for kind, message, seconds in results:
        assert kind == "ValueError" and "attention_dropout = 0.0" in message and "CP group rank 0" in message
        assert seconds < 10  # the agreement, not a timeout


def test_the_documented_call_without_model_refuses_an_sdpa_model_before_any_gradient():
    """The documented flow without model= (issue 20): an sdpa model ran no cp_packing attention, so the loss on the
    prepared step refuses it (gradients were 91% off before)."""
    from cp_packing import packed_cross_entropy

    model = model_from(config(), "sdpa")
    params = packed_seq_params_from_doc_ids(DOC)
    labels = next_token_labels(IDS, DOC)
    inputs = cp_model_inputs({"input_ids": IDS, "labels": labels}, params)
    logits = model(**inputs).logits[0]
    with pytest.raises(ValueError, match="no attention layer ran cp_packing's attention in this step"):
        packed_cross_entropy(logits, labels.reshape(-1), sharded=inputs["cp_sharded"])
