"""HF sliding-window models under CP: tiny random Mistral (one window for every layer) and Qwen2 with
``use_sliding_window=True`` and ``max_window_layers`` mixing full and sliding layers, float32.

The reference is HF's own eager model run on each document ALONE (positions 0..L-1, no mask given: HF builds its
sliding-window causal mask itself), so the window's exact off-by-one is HF's, not our reading of it. The CP loss
(sum of the ranks' shares) and gradients (summed over the ranks) must equal the loss and gradients of those
per-document runs, and every token's logits the document-alone logits.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config  # noqa: E402

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params  # noqa: E402
from cp_packing.hf import cp_model_inputs, register_cp_attention  # noqa: E402
from cp_packing.loss import next_token_labels, packed_cross_entropy  # noqa: E402
from cp_packing.padding import pad_segments  # noqa: E402
from cp_packing.testing import run_distributed  # noqa: E402
from tests.maps import segments_of  # noqa: E402
from tests.test_hf import _parity_worker  # noqa: E402

NAME = register_cp_attention()
RTOL, ATOL = 1e-4, 1e-5
KINDS = ("mistral", "qwen2")
WINDOW = {"mistral": 5, "qwen2": 6}


def make_model(kind: str, attn: str, *, windowed: bool = True) -> torch.nn.Module:
    """Tiny float32 random model (GQA 4/2 heads); ``windowed=False``: the same weights with full attention."""
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, attention_dropout=0.0)
    if kind == "mistral":
        cfg = MistralConfig(num_hidden_layers=2, head_dim=8, sliding_window=WINDOW[kind] if windowed else None,
                            **common)
    else:  # layer 0 full attention, layers 1 and 2 sliding
        cfg = Qwen2Config(num_hidden_layers=3, use_sliding_window=windowed, sliding_window=WINDOW[kind],
                          max_window_layers=1, **common)
        if windowed:
            assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    torch.manual_seed(4321)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()


# Rows of 12, B=5 (T=60): documents of 12, 9, 12, 7, 11 tokens (longer than both windows) and 3, 2, 1 (shorter);
# cp=2 cuts at 30 (row 2), cp=3 at 20 and 40 (inside row 1's and row 3's second documents); row-start boundaries
# between rows that all start with document 1; padding in row 3.
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


def make_case(layout: str, cp: int, seed: int = 0) -> dict:
    base = ZIGZAG_BASE_MAP if layout == "zigzag" else CONTIGUOUS_MAP
    g = torch.Generator().manual_seed(seed)
    base_ids = torch.randint(0, 128, base.shape, generator=g)
    base_labels = next_token_labels(base_ids, base, token_mask=base != 0)
    if layout == "zigzag":
        padded = pad_segments(base, multiple=2 * cp, tensors={"input_ids": base_ids})
        doc, ids = padded.doc_ids, padded.tensors["input_ids"]
        labels = next_token_labels(ids, doc, token_mask=~padded.is_pad)
    else:
        padded, doc, ids, labels = None, base, base_ids, base_labels
    return {"doc": doc, "ids": ids, "labels": labels, "padded": padded,
            "base": base, "base_ids": base_ids, "base_labels": base_labels}


def documents_alone(model: torch.nn.Module, base: torch.Tensor, base_ids: torch.Tensor, labels: torch.Tensor):
    """Each document run alone through HF eager (HF's own sliding mask): (logits [T, V], loss, grads), the loss
    over the original layout's labels (padding rows: zero logits, label -100)."""
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


def _compare(got_logits, got_loss, got_grads, ref, base) -> tuple[float, float, float]:
    """Loss, logits of the real tokens (padding logits are not defined by the reference) and every gradient."""
    ref_logits, ref_loss, ref_grads = ref
    real = base.reshape(-1) != 0
    got_logits, ref_logits = got_logits[real], ref_logits[real]
    torch.testing.assert_close(got_loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got_logits, ref_logits, rtol=RTOL, atol=ATOL)
    worst = 0.0
    for n, g in ref_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
        worst = max(worst, float((got_grads[n] - g).abs().max()))
    return float((got_loss - ref_loss).abs()), float((got_logits - ref_logits).abs().max()), worst


@pytest.mark.parametrize("kind", KINDS)
def test_the_window_matters_for_these_documents(kind):
    """The reference is not plain causal attention: for a document longer than the window, HF's sliding-window
    model gives other logits than the same weights with full attention (so the parity tests can fail)."""
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        windowed = make_model(kind, "eager")(input_ids=ids, use_cache=False).logits
        full = make_model(kind, "eager", windowed=False)(input_ids=ids, use_cache=False).logits
    w = WINDOW[kind]
    torch.testing.assert_close(windowed[:, :w], full[:, :w])  # inside the window: identical
    assert (windowed[:, w:] - full[:, w:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_cp1_sliding_window_matches_documents_alone(kind):
    model, eager = make_model(kind, NAME), make_model(kind, "eager")
    case = make_case("contiguous", 1)
    ref = documents_alone(eager, case["base"], case["base_ids"], case["base_labels"])
    logits = model(**cp_model_inputs(case["ids"], packed_seq_params_from_doc_ids(case["doc"]))).logits[0]
    loss = packed_cross_entropy(logits, case["labels"].reshape(-1))
    loss.backward()
    _compare(logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}, ref, case["base"])


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
@pytest.mark.parametrize("cp", [2, 3])
def test_cp_sliding_window_models_match_documents_alone(cp):
    """Both models at cp 2 (every layout) and 3 (each layout once, to keep the test short): loss shares sum to the
    documents-alone loss, SUM-reduced gradients equal its gradients, every token's logits equal the document-alone
    logits."""
    models = {kind: make_model(kind, NAME) for kind in KINDS}
    pairs = [(kind, layout) for kind in KINDS for layout in LAYOUTS]
    if cp == 3:
        pairs = [("mistral", "contiguous"), ("qwen2", "balanced"), ("qwen2", "zigzag")]
    cases = [(kind, layout, make_case(layout, cp, seed=cp)) for kind, layout in pairs]
    results = run_distributed(_parity_worker, cp, models, cases)
    report = {}
    for kind, layout, case in cases:
        ref = documents_alone(make_model(kind, "eager"), case["base"], case["base_ids"], case["base_labels"])
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
            {n: torch.from_numpy(x) for n, x in got["grads"].items()}, ref, case["base"],
        )
    print(f"cp={cp} max abs diff (loss, logits, grads): {report}")
