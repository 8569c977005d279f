"""What a rank holds: bytes saved for backward and the peak, per backend x layout x cp, against the one-process share.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py            (64K tokens, cp 2 and 4, ~15 min on 2 cores)
      PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py --quick    (2K tokens, cp 2, seconds)
      ... --backends exchange --layouts zigzag balanced --no-hf        (a few rows, no HF step: minutes)

One attention layer forward + backward (``context_parallel_attention`` on a step prepared by ``prepare_attention``)
on gloo ranks (CPU), bf16, 8 query / 2 key-value heads x 64, a lognormal doc map (documents a multiple of 8 tokens,
so zigzag takes it at cp 2 and 4), with a do-nothing kernel that allocates like flash-attn 2 (forward: ``out`` like
q and a float32 ``lse [H, T]``; backward: a float32 dq accumulator, the float32 softmax row sums, dK/dV expanded to
the query heads under GQA, then dq/dk/dv), installed in place of the ``"torch"`` kernel for the measurement. So the
figures are what the backend itself holds around the kernel.

* **saved**: the unique storages autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks`` collects
  every saved tensor; deduplicated by ``untyped_storage().data_ptr()``; the layer's output and the step's tables
  included).
* **peak**: the most bytes of torch's CPU allocator live at once during forward + ``torch.autograd.grad``, above
  what was live before (the inputs), from torch.profiler's memory records summed in time order (as
  benchmarks/bench_loss.py does).
* **ideal**: the same layer at cp 1 on the whole stream (no communication: the kernel alone), measured in this
  process, divided by cp. Each figure is the busiest rank's (the largest over the ranks) over the ideal.

The last table is a whole HF training step (a tiny 4-layer Llama, the chunked loss off, ``balanced``, the backend
``auto`` picks; the activations: the gradient is taken for the input embeddings, the weights' storages are not
counted) at cp 2 against the same step at cp 1. Figures: docs/benchmarks.md, "Memory per backend".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("allgather", "exchange", "ulysses", "hybrid")
LAYOUTS = ("contiguous", "zigzag", "balanced", "local")
HEADS, KV_HEADS, HEAD_DIM, DTYPE = 8, 2, 64, torch.bfloat16
MULTIPLE = 8  # every document a multiple of 2 * cp for cp <= 4 (zigzag)


# ------------------------------------------------------------------------------------------- the kernel stand-in


def _forward(q, k, v, *args):
    """flash-attn 2's forward allocations: ``out`` like q, ``lse [H, T]`` float32."""
    return q.new_zeros(q.shape), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)


def _backward(dout, q, k, v, out, lse, *args):
    """flash-attn 2's backward allocations: dq accumulator and softmax_d in float32, dK/dV at the query heads
    (GQA), summed into dk/dv."""
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # noqa: F841 (held like flash-attn's)
    softmax_d = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)  # noqa: F841
    dq = torch.zeros_like(q)
    if q.shape[1] != k.shape[1]:
        dk_expanded = k.new_zeros((k.shape[0], q.shape[1], k.shape[2]))
        dv_expanded = v.new_zeros((v.shape[0], q.shape[1], v.shape[2]))
        dk = dk_expanded.view(k.shape[0], k.shape[1], -1, k.shape[2]).sum(2)
        dv = dv_expanded.view(v.shape[0], v.shape[1], -1, v.shape[2]).sum(2)
        return dq, dk, dv
    return dq, torch.zeros_like(k), torch.zeros_like(v)


@contextlib.contextmanager
def flash_like_kernel():
    """The ``"torch"`` kernel replaced by the do-nothing stand-in (restored on exit)."""
    from cp_packing.attention import kernels

    saved = kernels._FORWARD["torch"], kernels._BACKWARD["torch"]
    kernels._FORWARD["torch"], kernels._BACKWARD["torch"] = _forward, _backward
    try:
        yield
    finally:
        kernels._FORWARD["torch"], kernels._BACKWARD["torch"] = saved


# ------------------------------------------------------------------------------------------------ measurement


def saved_bytes(fn, exclude=()) -> int:
    """Bytes of the unique storages autograd saves while ``fn()`` runs its forward (``fn`` returns the output),
    but those of the tensors in ``exclude`` (a model's weights)."""
    storages: dict[int, int] = {}
    skip = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def peak_bytes(fn) -> int:
    """The CPU allocator's most live bytes during ``fn()`` above the start (torch.profiler memory records)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_index() <= 0
              and str(e.device_type()).endswith("CPU")]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _inputs(T_local: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T_local, h, HEAD_DIM, generator=g).to(DTYPE) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]


def layer_memory(step, T_local: int, seed: int) -> tuple[int, int]:
    """``(saved, peak)`` bytes of one layer forward + backward on the prepared ``step``."""
    from cp_packing.attention import context_parallel_attention

    q, k, v, dout = _inputs(T_local, seed)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def forward():
        return context_parallel_attention(*leaves, step)

    def forward_backward():
        torch.autograd.grad(forward(), leaves, dout)

    forward_backward()  # warm-up: first-use allocations and caches
    return saved_bytes(forward), peak_bytes(forward_backward)


def _doc_ids(tokens: int):
    from cp_packing.testing import synthetic_doc_ids

    return synthetic_doc_ids("lognormal", 1, tokens, seed=0, median=2048, sigma=1.0, multiple=MULTIPLE)


def _step(doc_ids, cp: int, rank: int, layout: str, backend: str, group):
    from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
    from cp_packing.attention import prepare_attention

    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc_ids), cp_size=cp, cp_rank=rank,
                                      layout=layout)
    extra = {"ulysses_size": 2} if backend == "hybrid" else {}
    return prepare_attention(sharded, group=group, backend=backend, kernel="torch", check_layers=False,
                             num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DTYPE, **extra)


def _rank(rank: int, cp: int, tokens: int, layouts=LAYOUTS, backends=BACKENDS) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    doc_ids = _doc_ids(tokens)
    out = {}
    with flash_like_kernel():
        for layout in layouts:
            for backend in backends:
                step = _step(doc_ids, cp, rank, layout, backend, dist.group.WORLD)
                out[layout, backend] = layer_memory(step, tokens // cp, seed=rank)
    return out


def modelled_peak(tokens: int, cp: int, layout: str, backend: str) -> int | None:
    """The cost model's peak for the case (``None`` for a backend it does not model)."""
    from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
    from cp_packing.cost import backend_memory

    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(_doc_ids(tokens)), cp_size=cp, cp_rank=0,
                                      layout=layout)
    extra = {"ulysses_size": 2} if backend == "hybrid" else {}
    model = backend_memory(sharded, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=2, **extra)
    return model[backend][1] if backend in model else None


def one_process(tokens: int) -> tuple[int, int]:
    """The one-process figures (cp 1, the whole stream): ``(saved, peak)``."""
    with flash_like_kernel():
        return layer_memory(_step(_doc_ids(tokens), 1, 0, "contiguous", "allgather", None), tokens, seed=0)


# --------------------------------------------------------------------------------------------- the HF step


def _hf_step(model, batch, group, cp: int, rank: int) -> tuple[int, int]:
    import cp_packing
    from cp_packing.hf import cp_model_inputs

    if cp == 1:
        params = cp_packing.packed_seq_params_from_doc_ids(batch["doc_ids"])
        sharded = cp_packing.shard_packed_seq_params(params, cp_size=1, cp_rank=0, layout="balanced")
        local = {key: sharded.shard(x).reshape(1, -1) for key, x in batch.items()}
    else:
        local, sharded = cp_packing.distribute_batch(batch, group=group, layout="balanced")
    inputs = cp_model_inputs(local, sharded, group=group, model=model)
    params = list(model.parameters())
    for p in params:  # the activations' memory only: the weights and their gradients do not shrink with cp
        p.requires_grad_(False)
    embeds = model.get_input_embeddings()(inputs.pop("input_ids")).detach().requires_grad_()

    def forward():
        logits = model(inputs_embeds=embeds, **inputs).logits[0]
        return cp_packing.packed_cross_entropy(logits, local["labels"][0], sharded=inputs["cp_sharded"])

    def forward_backward():
        torch.autograd.grad(forward(), [embeds])

    forward_backward()
    return saved_bytes(forward, exclude=params), peak_bytes(forward_backward)


def _model():
    import transformers

    from cp_packing.hf import register_cp_attention

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                      max_position_embeddings=1 << 17)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=register_cp_attention())


def _hf_batch(tokens: int) -> dict:
    import cp_packing

    doc_ids = _doc_ids(tokens)
    input_ids = torch.randint(0, 128, doc_ids.shape, generator=torch.Generator().manual_seed(0))
    return {"input_ids": input_ids, "doc_ids": doc_ids, "labels": cp_packing.next_token_labels(input_ids, doc_ids)}


def _hf_rank(rank: int, cp: int, tokens: int) -> tuple[int, int]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    with flash_like_kernel():
        return _hf_step(_model(), _hf_batch(tokens), dist.group.WORLD, cp, rank)


def hf_one_process(tokens: int) -> tuple[int, int]:
    with flash_like_kernel():
        return _hf_step(_model(), _hf_batch(tokens), None, 1, 0)


# ---------------------------------------------------------------------------------------------------- report


def main() -> None:
    from cp_packing.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--hf-tokens", type=int, default=32768)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="the rows' backends")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="the rows' layouts")
    p.add_argument("--no-hf", action="store_true", help="skip the HF step's table")
    p.add_argument("--quick", action="store_true", help="smoke run: 2K tokens (1K for the HF step), cp 2")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.hf_tokens, args.cp = 2048, 1024, [2]
    mib = 2 ** 20
    base_saved, base_peak = one_process(args.tokens)
    print(f"T={args.tokens} tokens, {HEADS} query / {KV_HEADS} key-value heads x {HEAD_DIM}, bf16, do-nothing "
          f"flash-like kernel; one process (cp 1): saved {base_saved / mib:.1f} MiB, peak {base_peak / mib:.1f} MiB; "
          f"q/k/v/out of the whole stream {args.tokens * (2 * HEADS + 2 * KV_HEADS) * HEAD_DIM * 2 / mib:.1f} MiB\n")
    results = {cp: run_distributed(_rank, cp, args.tokens, tuple(args.layouts), tuple(args.backends), timeout=3000)
               for cp in args.cp}
    cps = " / ".join(str(cp) for cp in args.cp)
    print(f"| backend | layout | saved / ideal, cp {cps} | peak / ideal, cp {cps} | busiest peak MiB, cp {cps} | "
          f"modelled peak MiB (cost.backend_memory), cp {cps} |")
    print("|---|---|---|---|---|---|")
    for backend in args.backends:
        for layout in args.layouts:
            saved = [max(r[layout, backend][0] for r in results[cp]) / (base_saved / cp) for cp in args.cp]
            peak = [max(r[layout, backend][1] for r in results[cp]) for cp in args.cp]
            model = [modelled_peak(args.tokens, cp, layout, backend) for cp in args.cp]
            print(f"| {backend} | {layout} | {' / '.join(f'{x:.2f}' for x in saved)} | "
                  f"{' / '.join(f'{x / (base_peak / cp):.2f}' for x, cp in zip(peak, args.cp))} | "
                  f"{' / '.join(f'{x / mib:.1f}' for x in peak)} | "
                  f"{' / '.join('-' if x is None else f'{x / mib:.1f}' for x in model)} |")
    if args.no_hf:
        return
    hf_saved, hf_peak = hf_one_process(args.hf_tokens)
    ranks = run_distributed(_hf_rank, 2, args.hf_tokens, timeout=3000)
    saved, peak = max(r[0] for r in ranks), max(r[1] for r in ranks)
    print(f"\nHF step (tiny Llama, 4 layers, hidden 512, {args.hf_tokens} tokens, balanced, backend auto): "
          "the whole step at cp 2 against cp 1 / 2\n")
    print("| step | saved MiB | saved / ideal | peak MiB | peak / ideal |")
    print("|---|---|---|---|---|")
    print(f"| cp 1 | {hf_saved / mib:.1f} | 2.00 | {hf_peak / mib:.1f} | 2.00 |")
    print(f"| cp 2, busiest rank | {saved / mib:.1f} | {saved / (hf_saved / 2):.2f} | {peak / mib:.1f} | "
          f"{peak / (hf_peak / 2):.2f} |")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
