"""Compiled vs eager: the step time of a tiny HF Llama under CP, per backend, and what torch.compile saw.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/bench_compile.py            (2 gloo ranks, inductor, every backend)
      PYTHONPATH=. .venv/bin/python benchmarks/bench_compile.py --quick    (aot_eager, two backends, smaller: a smoke run)

Per backend (all-gather, exchange, Ulysses, hybrid with ``ulysses_size=2``), on 2 gloo ranks: ``--steps`` training
steps (forward + loss + backward) of a tiny Llama on new lognormal maps of one shape, the step prepared by
``cp_model_inputs(..., model=model)``; first eagerly, then with ``torch.compile(model, backend=...)`` (the first
compiled step, which compiles, is not timed). Reported: the median step time of each mode on rank 0, the ratio
compiled / eager, dynamo's graph breaks (0 expected) and the compiled frames after the last step (a new map of the
same shape must not recompile: 1 frame per graph). On CPU the model is tiny: the ratio says what compile does to
the Python and kernel-launch share of a step, not what it does on a GPU at scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

BACKENDS = ("allgather", "exchange", "ulysses", "hybrid")


def _model(layers: int, hidden: int):
    import transformers

    from cp_packing.hf import register_cp_attention

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096, attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=register_cp_attention())


def _inputs(model, step: int, seq: int, backend: str, group):
    import cp_packing
    from cp_packing.hf import cp_model_inputs
    from cp_packing.testing import synthetic_doc_ids

    doc = synthetic_doc_ids("lognormal", batch=1, seqlen=seq, seed=step, median=seq // 8)
    ids = torch.randint(0, 256, doc.shape, generator=torch.Generator().manual_seed(step))
    local, sharded = cp_packing.distribute_batch({"input_ids": ids, "labels": cp_packing.next_token_labels(ids, doc)},
                                                 cp_packing.packed_seq_params_from_doc_ids(doc), group=group,
                                                 layout="contiguous")
    options = {"backend": backend} | ({"ulysses_size": 2} if backend == "hybrid" else {})
    return cp_model_inputs(local, sharded, group=group, model=model, **options), local["labels"][0]


def _time_steps(call, model, batches) -> list[float]:
    import cp_packing

    times = []
    for inputs, labels in batches:
        t0 = time.perf_counter()
        loss = cp_packing.packed_cross_entropy(call(**inputs).logits[0], labels, sharded=inputs["cp_sharded"])
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def _rank(rank: int, world: int, backends, compiler: str, steps: int, seq: int, layers: int, hidden: int) -> dict:
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    group, out = dist.group.WORLD, {}
    for backend in backends:
        model = _model(layers, hidden)
        batches = [_inputs(model, i, seq, backend, group) for i in range(steps + 1)]
        eager = _time_steps(model, model, batches[1:])
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounterWithBackend(compiler)
        compiled = torch.compile(model, backend=counter)
        t0 = time.perf_counter()
        _time_steps(compiled, model, batches[:1])  # compiles
        compile_s = time.perf_counter() - t0
        fresh = [_inputs(model, 100 + i, seq, backend, group) for i in range(steps)]  # new maps, same shape
        timed = _time_steps(compiled, model, fresh)
        out[backend] = {"eager": statistics.median(eager), "compiled": statistics.median(timed),
                        "compile_s": compile_s, "breaks": sum(counters["graph_break"].values()),
                        "frames": counter.frame_count}
    return out


def run(backends, compiler: str, steps: int, seq: int, layers: int, hidden: int) -> dict:
    from cp_packing.testing import run_distributed

    return run_distributed(_rank, 2, tuple(backends), compiler, steps, seq, layers, hidden, timeout=1800)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="aot_eager, all-gather and exchange, small (a smoke run)")
    a = p.parse_args(argv)
    if a.quick:
        a.backends, a.compiler, a.steps, a.seq, a.layers = ["allgather", "exchange"], "aot_eager", 2, 128, 2
    results = run(a.backends, a.compiler, a.steps, a.seq, a.layers, a.hidden)
    print(f"Tiny Llama ({a.layers} layers, hidden {a.hidden}), {a.seq} tokens, cp 2 on gloo (CPU, one thread a rank), "
          f"contiguous; torch.compile backend {a.compiler!r}; median of {a.steps} steps on rank 0\n")
    print("| backend | eager step (ms) | compiled step (ms) | compiled / eager | first compiled step (s) | graph breaks "
          "| frames after new maps |")
    print("|---|---|---|---|---|---|---|")
    for backend, r in results.items():
        print(f"| {backend} | {1e3 * r['eager']:.1f} | {1e3 * r['compiled']:.1f} | {r['compiled'] / r['eager']:.2f} "
              f"| {r['compile_s']:.1f} | {r['breaks']} | {r['frames']} |")
    return 0 if all(r["breaks"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
