"""Nonsense that was accepted, and errors that named neither the value nor the fix (issue 26): each is refused at
the call with a one-line TypeError / ValueError naming the value and what to pass instead."""

from __future__ import annotations

import math
import re

import pytest
import torch

from cp_packing import AttentionOptions, choose_layout, layout_cost, packed_seq_params_from_doc_ids
from cp_packing._checks import MAX_SOFTMAX_SCALE, check_softmax_scale, check_window
from cp_packing.layouts import expand_runs


@pytest.mark.parametrize("scale", [math.inf, -math.inf, 1e300, 0.0, -0.125, 10 * MAX_SOFTMAX_SCALE])
def test_a_softmax_scale_that_overflows_the_scores_is_refused(scale):
    """``softmax_scale=inf`` or ``1e300`` gave NaN outputs silently: refused, naming the value and the default."""
    with pytest.raises(ValueError, match=_scale_refused(scale)):
        check_softmax_scale(scale)


def _scale_refused(scale: float) -> str:
    return (rf"softmax_scale must be a finite number in \(0, 1e\+06\].*got {re.escape(repr(scale))}; .*or None for "
            r"1/sqrt\(head_dim\)")


@pytest.mark.parametrize("where", ["call", "options"])
def test_attention_refuses_an_infinite_softmax_scale_on_the_call_and_in_the_options(where):
    from cp_packing.attention import context_parallel_attention, prepare_attention
    from cp_packing.sharding import shard_packed_seq_params

    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2]]))
    shard = shard_packed_seq_params(params, cp_size=1, cp_rank=0, layout="contiguous")
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match=_scale_refused(math.inf)):
        if where == "options":
            AttentionOptions(scale=math.inf)
        else:
            context_parallel_attention(q, q, q, prepare_attention(shard), softmax_scale=math.inf)


def test_a_real_softmax_scale_passes_and_overflows_nothing():
    """What passes is a float, and the largest passing scale times unit-sized bf16 q.k stays finite in float32
    (the reference: torch's own softmax)."""
    assert check_softmax_scale(None) is None and check_softmax_scale(1) == 1.0
    assert check_softmax_scale(1 / math.sqrt(128)) == 1 / math.sqrt(128)
    q = torch.ones(4, 64, dtype=torch.bfloat16)
    scores = check_softmax_scale(MAX_SOFTMAX_SCALE) * (q.float() @ q.float().T)
    assert torch.isfinite(torch.softmax(scores, -1)).all()
    with pytest.raises(TypeError, match="softmax_scale must be a number, got 'x'"):
        check_softmax_scale("x")


def test_a_window_beyond_int32_is_refused_at_every_entry():
    """``window=2**70`` gave ``OverflowError: Python int too large to convert to C long`` deep in the cost model;
    refused in ``check_window`` (every entry reads it), naming the value and None."""
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2]]))
    calls = [lambda: check_window(2**70),
             lambda: layout_cost(params, cp_size=2, layout="contiguous", window=2**70),
             lambda: layout_cost(params, cp_size=2, layout="contiguous", window=[2**70, None]),
             lambda: choose_layout(params, cp_size=2, window=2**70),
             lambda: AttentionOptions(window=2**70)]
    for call in calls:
        with pytest.raises(ValueError, match=r"window(\[0\])? must be <= 2147483647, got 1180591620717411303424;"
                                             r".*or None for full attention"):
            call()
    assert check_window(2**31 - 1) == 2**31 - 1  # int32 cu_seqlens index at most this many tokens


@pytest.mark.parametrize("starts,lens,total,got", [([0, 10], [3, 3], 4, 6), ([0, 10], [3, 3], 7, 6),
                                                   ([0, 10], [3, -1], 2, 2)])
def test_expand_runs_refuses_runs_that_do_not_tile_the_output(starts, lens, total, got):
    """``expand_runs([0, 10], [3, 3], total=4)`` returned ``[0, 1, 2, 10]`` (the second run cut short, silently)."""
    with pytest.raises(ValueError, match=rf"must be >= 0 and sum to total={total} .* got sum {got}; pass "
                                         r"total=int\(run_len.sum\(\)\)"):
        expand_runs(torch.tensor(starts), torch.tensor(lens), total)


def test_expand_runs_still_lays_out_runs_that_tile_the_output():
    starts, lens = torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3])
    reference = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())])
    assert expand_runs(starts, lens, int(lens.sum())).tolist() == reference.tolist() == [5, 6, 9, 10, 11]


# HF families a registered attention function cannot run (the lead wires the checks into cp_packing.hf)

def _falcon_config():
    from transformers import FalconConfig

    return FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        new_decoder_architecture=True, num_kv_heads=2)


def test_falcon_picks_its_attention_class_from_a_fixed_table_so_a_registered_name_is_a_key_error():
    """Why Falcon under ``register_cp_attention()`` fails with a bare ``KeyError: 'cp_packing'`` inside
    ``from_config``: transformers 5.x accepts any registered name (``get_correct_attn_implementation`` checks only
    ``ALL_ATTENTION_FUNCTIONS``), but Falcon's decoder layer indexes ``FALCON_ATTENTION_CLASSES`` (eager, sdpa,
    flash_attention_2), and its class says so: ``is_backend_compatible()`` (``_supports_attention_backend``) is
    False, unlike Llama's. cp_packing must refuse such a family before ``from_config``, from the config alone."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, FalconForCausalLM, LlamaForCausalLM

    from cp_packing.hf import register_cp_attention
    from cp_packing.model_features import check_cp_supported

    name = register_cp_attention()
    with pytest.raises(KeyError, match=name):
        AutoModelForCausalLM.from_config(_falcon_config(), attn_implementation=name)
    assert not FalconForCausalLM.is_backend_compatible() and LlamaForCausalLM.is_backend_compatible()
    with pytest.raises(ValueError, match=r"FalconForCausalLM \(falcon\): its attention is computed inside the model, "
                                         r"not through transformers' AttentionInterface"):
        check_cp_supported(_falcon_config())  # the pre-check a caller (or the launcher) can run first


def test_check_cp_model_names_falcon_rather_than_asking_to_switch_its_implementation():
    """A Falcon built with sdpa (the only way it builds): ``check_cp_model`` said "runs 'sdpa', not cp_packing's ...
    set model.set_attn_implementation(...)", a fix that cannot work for Falcon. It must name the family."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from cp_packing.hf import check_cp_model

    model = AutoModelForCausalLM.from_config(_falcon_config(), attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"FalconForCausalLM \(falcon\): its attention is computed inside the model"):
        check_cp_model(model)


def test_the_launcher_refuses_a_falcon_directory_as_a_usage_error(tmp_path, capfd):
    """``python -m cp_packing train --model <falcon dir>``: the dry run passed and the run died with
    ``KeyError: 'cp_packing'`` tracebacks on every rank. It must be a usage line naming the family (exit 2)."""
    pytest.importorskip("transformers")
    from transformers import FalconForCausalLM

    from cp_packing.tools import train

    FalconForCausalLM(_falcon_config()).save_pretrained(tmp_path / "falcon")
    code = train.main(["--nproc", "2", "--model", str(tmp_path / "falcon"), "--dry-run"])
    err = capfd.readouterr().err
    assert code == 2 and "falcon" in err and "AttentionInterface" in err and "Traceback" not in err, err


@pytest.mark.distributed
def test_deepseek_v3_with_mla_head_sizes_matches_its_documents_alone():
    """DeepSeek-V3's multi-head latent attention with its real head sizes (q/k head dim qk_nope + qk_rope = 12, v
    head dim 8) got "k and v must have the same shape" at the first forward. The attention now pads v to the q/k
    head dim and crops the output (as HF's flash-attention integration does; exact: the weights do not depend on
    v): CP at cp 2, eager and compiled, equals HF's eager model run on each document alone."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config

    from tests.test_model_features import _sweep_module

    from cp_packing.hf import register_cp_attention

    sweep = _sweep_module()
    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                              first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                              topk_group=1, attention_dropout=0.0)
    eager, model = sweep.build(config, "eager"), sweep.build(config, register_cp_attention())
    case = sweep.make_case(64)
    ref = sweep.documents_alone(eager, case)
    job = {"dsv3": {"model": model, "case": case, "ref": ref, "guard": True}}
    for compiled in (False, True):
        kind, value = sweep.run_cp(job, 2, "contiguous", 120, compiled=compiled)["dsv3"]
        assert kind == "ok", value
        d_loss, d_grad, ok = sweep.compare(*value, *ref)
        assert ok and d_loss < 1e-5, (compiled, d_loss, d_grad)
