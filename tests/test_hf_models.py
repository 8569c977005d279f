"""HF model families with sliding windows, logit soft-capping and attention sinks under CP, float32.

Tiny random models built from configs (``FAMILIES``): Mistral (one window for every layer), Qwen2
(``use_sliding_window=True``, ``max_window_layers`` mixing full and sliding layers), Gemma 2 (soft-capping,
alternating sliding/global layers), Gemma 3 text (sliding/global), gpt-oss (attention sinks, sliding/global, a tiny
MoE) and Phi-3 (sliding window). Every window (5 or 6) is shorter than some documents and longer than others.

The reference is HF's own eager model run on each document ALONE (positions 0..L-1, no mask given: HF builds its
sliding-window causal mask, caps the scores and appends the sinks itself), so the window's off-by-one, the order
of scale and softcap and the sink's place in the softmax are HF's, not our reading of them. The CP loss (sum of
the ranks' shares) and gradients (summed over the ranks, sinks included) must equal the loss and gradients of
those per-document runs, and every token's logits the document-alone logits.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params  # noqa: E402
from cp_packing.hf import cp_model_inputs, register_cp_attention  # noqa: E402
from cp_packing.loss import next_token_labels, packed_cross_entropy  # noqa: E402
from cp_packing.padding import pad_segments  # noqa: E402
from cp_packing.testing import run_distributed  # noqa: E402
from tests.maps import segments_of  # noqa: E402
from tests.test_hf import _parity_worker  # noqa: E402

NAME = register_cp_attention()
RTOL, ATOL = 1e-4, 1e-5
NO_WINDOW = 256  # a window no document reaches: the same model with full causal attention
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ALTERNATING = ["sliding_attention", "full_attention"]


def _mistral(window, extras):
    return MistralConfig(num_hidden_layers=2, head_dim=8, sliding_window=window, **COMMON)


def _qwen2(window, extras):  # layer 0 full attention, layers 1 and 2 sliding
    return Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=window, max_window_layers=1,
                       **COMMON)


def _gemma2(window, extras):  # soft-capping bites at this init (scores of order 1)
    return Gemma2Config(num_hidden_layers=2, head_dim=8, sliding_window=window, layer_types=ALTERNATING,
                        query_pre_attn_scalar=8, attn_logit_softcapping=1.0 if extras else None,
                        initializer_range=0.1, **COMMON)


def _gemma3(window, extras):
    return Gemma3TextConfig(num_hidden_layers=2, head_dim=8, sliding_window=window, layer_types=ALTERNATING,
                            query_pre_attn_scalar=8, initializer_range=0.1, **COMMON)


def _gpt_oss(window, extras):  # attention sinks in every layer, 4 experts (2 per token)
    return GptOssConfig(num_hidden_layers=2, head_dim=8, sliding_window=window, layer_types=ALTERNATING,
                        num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON)


def _phi3(window, extras):
    return Phi3Config(num_hidden_layers=2, sliding_window=window, **COMMON)


# family -> (config builder, window, what else its attention does). One table for every test below.
FAMILIES = {
    "mistral": (_mistral, 5, None),
    "qwen2": (_qwen2, 6, None),
    "gemma2": (_gemma2, 5, "softcap"),
    "gemma3": (_gemma3, 5, None),
    "gpt_oss": (_gpt_oss, 5, "sinks"),
    "phi3": (_phi3, 6, None),
}
KINDS = tuple(FAMILIES)


def make_model(kind: str, attn: str, *, windowed: bool = True, extras: bool = True) -> torch.nn.Module:
    """Tiny float32 random model (GQA 4/2 heads), the same weights for the same kind whatever the flags.

    ``windowed=False``: the window widened past every document (full causal attention, nothing else changes);
    ``extras=False``: without the family's soft-capping, and with its sinks at -1e4 (they then take no mass)."""
    build, window, _ = FAMILIES[kind]
    cfg = build(window if windowed else NO_WINDOW, extras)
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(4) if extras else torch.full((4,), -1e4))
    return model


# Rows of 12, B=5 (T=60): documents of 12, 9, 12, 7, 11 tokens (longer than every window) and 3, 2, 1 (shorter);
# cp=2 cuts at 30 (row 2), cp=3 at 20 and 40, cp=4 at 15, 30, 45 (inside documents); row-start boundaries between
# rows that all start with document 1; padding in row 3.
CONTIGUOUS_MAP = torch.tensor([
    [1] * 12,
    [1] * 3 + [2] * 9,
    [1] * 12,
    [1] * 2 + [2] * 7 + [0] * 3,
    [1] * 1 + [2] * 11,
])
ZIGZAG_BASE_MAP = torch.tensor([  # re-laid with pad_segments(map, multiple=2 * cp)
    [1] * 11 + [2] * 5,
    [1] * 3 + [2] * 9 + [0] * 4,
])
LAYOUTS = ("contiguous", "balanced", "zigzag")


def _base(zigzag: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(doc map, input ids, labels) of the original (unpadded) batch; one seed, so references are shared."""
    base = ZIGZAG_BASE_MAP if zigzag else CONTIGUOUS_MAP
    ids = torch.randint(0, 128, base.shape, generator=torch.Generator().manual_seed(7))
    return base, ids, next_token_labels(ids, base, token_mask=base != 0)


def make_case(layout: str, cp: int) -> dict:
    base, base_ids, base_labels = _base(layout == "zigzag")
    if layout == "zigzag":
        padded = pad_segments(base, multiple=2 * cp, tensors={"input_ids": base_ids})
        doc, ids = padded.doc_ids, padded.tensors["input_ids"]
        labels = next_token_labels(ids, doc, token_mask=~padded.is_pad)
    else:
        padded, doc, ids, labels = None, base, base_ids, base_labels
    return {"doc": doc, "ids": ids, "labels": labels, "padded": padded, "base": base}


def documents_alone(model: torch.nn.Module, base: torch.Tensor, base_ids: torch.Tensor, labels: torch.Tensor):
    """Each document run alone through HF eager (HF's own masks, softcap and sinks): (logits [T, V], loss, grads),
    the loss over the original layout's labels (padding rows: zero logits, label -100)."""
    model.zero_grad(set_to_none=True)
    flat_doc, flat_ids = base.reshape(-1), base_ids.reshape(-1)
    rows = []
    for a, b in segments_of(base):
        if int(flat_doc[a]) == 0:
            rows.append(torch.zeros(b - a, model.config.vocab_size))
        else:
            rows.append(model(input_ids=flat_ids[a:b].reshape(1, -1), use_cache=False).logits[0])
    logits = torch.cat(rows)  # [T, V]
    loss = packed_cross_entropy(logits, labels.reshape(-1))
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def reference(kind: str, zigzag: bool):
    """``documents_alone`` of the eager model on the contiguous map or the zigzag base map (computed once)."""
    return documents_alone(make_model(kind, "eager"), *_base(zigzag))


def _compare(got_logits, got_loss, got_grads, ref, base) -> tuple[float, float, float]:
    """Loss, logits of the real tokens (padding logits are not defined by the reference) and every gradient."""
    ref_logits, ref_loss, ref_grads = ref
    real = base.reshape(-1) != 0
    got_logits, ref_logits = got_logits[real], ref_logits[real]
    torch.testing.assert_close(got_loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got_logits, ref_logits, rtol=RTOL, atol=ATOL)
    worst = 0.0
    assert set(got_grads) == set(ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
        worst = max(worst, float((got_grads[n] - g).abs().max()))
    return float((got_loss - ref_loss).abs()), float((got_logits - ref_logits).abs().max()), worst


def test_every_family_is_built_with_the_features_under_test():
    """The configs really have what the parity tests claim: sliding and full layers where stated, the window,
    Gemma 2's soft-capping on every layer, gpt-oss's sinks as trained parameters."""
    for kind in KINDS:
        model = make_model(kind, "eager")
        window = FAMILIES[kind][1]
        attns = [layer.self_attn for layer in model.model.layers]
        windows = [getattr(a, "sliding_window", model.config.sliding_window) for a in attns]  # what HF passes
        assert window in windows, (kind, windows)
        if kind in ("qwen2", "gemma2", "gemma3", "gpt_oss"):
            assert None in windows, (kind, windows)  # global layers too
        if kind == "gemma2":
            assert all(a.attn_logit_softcapping == 1.0 for a in attns)
        if kind == "gpt_oss":
            assert all(a.sinks.requires_grad and a.sinks.shape == (4,) for a in attns)


@pytest.mark.parametrize("kind", KINDS)
def test_the_features_matter_for_these_documents(kind):
    """The reference is not plain causal attention: for a 12-token document, the window (5 or 6) changes HF's
    logits past the window and not inside it; Gemma 2's soft-capping and gpt-oss's sinks change them too. So the
    parity tests below can fail."""
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = make_model(kind, "eager")(input_ids=ids, use_cache=False).logits
        full = make_model(kind, "eager", windowed=False)(input_ids=ids, use_cache=False).logits
        w = FAMILIES[kind][1]
        torch.testing.assert_close(logits[:, :w], full[:, :w])  # inside the window: identical
        assert (logits[:, w:] - full[:, w:]).abs().max() > 1e-3
        if FAMILIES[kind][2] is not None:
            plain = make_model(kind, "eager", extras=False)(input_ids=ids, use_cache=False).logits
            assert (logits - plain).abs().max() > 1e-2, FAMILIES[kind][2]


def test_default_mistral_config_is_no_longer_refused():
    """The issue's first report: a default MistralConfig (sliding_window=4096) runs, equal to eager."""
    cfg = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    assert cfg.sliding_window == 4096
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    case = make_case("contiguous", 1)
    with torch.no_grad():
        logits = model(**cp_model_inputs(case["ids"], packed_seq_params_from_doc_ids(case["doc"]))).logits[0]
        model.set_attn_implementation("eager")
        a, b = segments_of(case["doc"])[0]
        alone = model(input_ids=case["ids"].reshape(-1)[a:b].reshape(1, -1), use_cache=False).logits[0]
    torch.testing.assert_close(logits[a:b], alone, rtol=RTOL, atol=ATOL)


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_models_match_documents_alone(cp):
    """One spawn per cp size: loss shares sum to the documents-alone loss, SUM-reduced gradients (gpt-oss's sinks
    included) equal its gradients, every token's logits equal the document-alone logits: every family in every layout."""
    models = {kind: make_model(kind, NAME) for kind in KINDS}
    pairs = [(kind, layout) for kind in KINDS for layout in LAYOUTS]
    cases = [(kind, layout, make_case(layout, cp)) for kind, layout in pairs]
    results = run_distributed(_parity_worker, cp, models, cases)
    report = {}
    for kind, layout, case in cases:
        got = results[0][(kind, layout)]
        sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(case["doc"]), cp_size=cp, cp_rank=0,
                                          layout=layout)
        logits = sharded.unshard([torch.from_numpy(x) for x in got["logits"]])  # [B, S, V] (padded) layout
        logits = logits.reshape(*case["doc"].shape, -1)
        if case["padded"] is not None:
            logits = case["padded"].unpad(logits)  # the original layout
        assert sum(abs(x) > 0 for x in got["shares"]) >= 2  # genuine shares, not the loss on every rank
        report[(kind, layout)] = _compare(
            logits.reshape(-1, logits.shape[-1]), torch.tensor(sum(got["shares"]), dtype=torch.float32),
            {n: torch.from_numpy(x) for n, x in got["grads"].items()}, reference(kind, layout == "zigzag"),
            case["base"],
        )
    print(f"cp={cp} max abs diff (loss, logits, grads): {report}")
