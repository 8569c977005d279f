"""Trace one CP training step: cp-packing calls per phase, per layer and per step, and the per-layer Python overhead.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/trace_step.py            (2 gloo ranks, tiny 4-layer Llama, balanced)
      PYTHONPATH=. .venv/bin/python benchmarks/trace_step.py --quick    (fewer timing repeats)

Part 1 (2 ranks, gloo): one training step of a tiny Llama (``--layers`` decoder layers) on a lognormal packed batch,
``balanced`` layout, the backend ``auto`` picks (the exchange or the all-gather): the batch is distributed
(``distribute_batch``), the step is prepared and agreed (``cp_model_inputs(..., model=model)``), then forward, loss
(``packed_cross_entropy``) and backward. A
``sys.setprofile`` hook counts every call of a function defined in ``cp_packing/`` (per phase; the forward and
backward phases divided by the number of layers give the per-layer figures), and names the busiest functions.
Two steps are traced: the second (a checked step: the first ``CHECKED_STEPS`` steps of a group make a small
agreement per layer) and the fourth (a later step: layers only read the step plan, prepared before the model call,
so layer 1 costs what the others cost); step one pays imports and first use. The reference kernel's own helpers (``attention/kernels.py``) are counted apart: they are the kernel.

Part 2 (one process, cp = 1): the Python overhead of one attention layer's forward as HF calls it
(``cp_packing.hf.cp_attention_forward``) with the varlen kernel replaced by a do-nothing kernel (it returns its
query and a zero lse), after the step's preparation: the median time per call over ``--repeats`` calls, minus the
do-nothing kernel's own time measured in the same run.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time

import torch

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cp_packing") + os.sep


def _model(layers: int):
    import transformers

    from cp_packing.hf import register_cp_attention

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=register_cp_attention())


class _Counter:
    """Counts calls of functions defined under cp_packing/, per phase, via sys.setprofile (this thread and new ones)."""

    def __init__(self):
        self.phase = "idle"
        self.calls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def _hook(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PKG):
            code = frame.f_code
            name = f"{code.co_filename[len(PKG):]}:{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}"
            if name == "hf.py:cp_attention_forward" and self.phase.startswith("forward"):
                self.phase = "forward, layer 1" if self.phase == "forward" else "forward, layers 2.."
            self.calls[self.phase][name] += 1

    def __enter__(self):
        sys.setprofile(self._hook)
        threading.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def _batch(step: int, seq: int):
    import cp_packing
    from cp_packing.testing import synthetic_doc_ids

    doc_ids = synthetic_doc_ids("lognormal", batch=1, seqlen=seq, seed=step, median=40)
    g = torch.Generator().manual_seed(step)
    input_ids = torch.randint(0, 128, doc_ids.shape, generator=g)
    return {"input_ids": input_ids, "doc_ids": doc_ids,
            "labels": cp_packing.next_token_labels(input_ids, doc_ids)}


def _step(model, batch, group, counter: _Counter | None):
    import cp_packing
    from cp_packing.hf import cp_model_inputs

    def phase(name):
        if counter is not None:
            counter.phase = name

    phase("prepare")
    local, sharded = cp_packing.distribute_batch(batch, group=group, layout="balanced")
    inputs = cp_model_inputs(local, sharded, group=group, model=model)
    phase("forward")
    logits = model(**inputs).logits[0]
    phase("loss")
    loss = cp_packing.packed_cross_entropy(logits, local["labels"][0], sharded=inputs["cp_sharded"])  # local math
    phase("backward")
    loss.backward()
    phase("idle")
    return float(loss.detach())


def _trace_rank(rank: int, world: int, layers: int, seq: int) -> dict:
    import torch.distributed as dist

    model = _model(layers)
    group = dist.group.WORLD
    out = {}
    for step in range(4):  # step 0: imports and first use; 1: a checked step (check_layers); 3: a later one
        if step in (1, 3):
            with _Counter() as counter:
                _step(model, _batch(step, seq), group, counter)
            out["checked" if step == 1 else "later"] = {phase: dict(c) for phase, c in counter.calls.items()}
        else:
            _step(model, _batch(step, seq), group, None)
    return out


def trace(layers: int, seq: int) -> dict:
    from cp_packing.testing import run_distributed

    return run_distributed(_trace_rank, 2, layers, seq, timeout=600)[0]


# ------------------------------------------------------------------------------------------------ per-layer overhead


class _Module(torch.nn.Module):
    is_causal = True


def overhead_us(repeats: int, tokens: int = 64) -> tuple[float, float]:
    """(median time of one cp_attention_forward call with a do-nothing kernel, the kernel's own time), in us."""
    import cp_packing
    from cp_packing.attention import kernels
    from cp_packing.hf import cp_attention_forward, cp_model_inputs

    def noop(q, k, v, *args, **kwargs):  # a fresh output, as a kernel's (an op's output never aliases its input)
        return torch.empty_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)

    doc_ids = torch.tensor([[1] * (tokens // 2) + [2] * (tokens // 2)])
    params = cp_packing.packed_seq_params_from_doc_ids(doc_ids)
    inputs = cp_model_inputs(torch.zeros_like(doc_ids), params)
    extra = {k: v for k, v in inputs.items() if k.startswith("cp_")}
    # as HF passes them: [1, T, H, D] projections viewed as [1, H, T, D]; training: the layer records its node
    q = torch.randn(1, tokens, 4, 16, requires_grad=True).transpose(1, 2)
    kv = torch.randn(1, tokens, 2, 16, requires_grad=True).transpose(1, 2)
    module = _Module()
    saved = dict(kernels._FORWARD)
    kernels._FORWARD["torch"] = noop
    try:
        def layer():
            cp_attention_forward(module, q, kv, kv, None, scaling=0.25, **extra)

        def kernel():
            noop(q, kv, kv)

        times = {}
        for name, fn in (("layer", layer), ("kernel", kernel)):
            for _ in range(50):
                fn()
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter_ns()
                for _ in range(20):
                    fn()
                samples.append((time.perf_counter_ns() - t0) / 20 / 1000)
            times[name] = statistics.median(samples)
    finally:
        kernels._FORWARD.clear()
        kernels._FORWARD.update(saved)
    return times["layer"], times["kernel"]


KERNEL = "attention/kernels.py"  # the reference kernel's own helpers: the kernel's work, not the library's


def _table(steps: dict, layers: int) -> str:
    lines = ["| phase | " + " | ".join(f"{name} step: calls (kernel) | per layer" for name in steps) + " |",
             "|---|" + "---|---|" * len(steps)]
    totals = {name: [0, 0] for name in steps}
    for phase in ("prepare", "forward", "forward, layer 1", "forward, layers 2..", "loss", "backward"):
        cells = []
        for name, calls in steps.items():
            counted = calls.get(phase, {})
            n = sum(counted.values())
            kernel = sum(c for f, c in counted.items() if f.startswith(KERNEL))
            totals[name][0] += n
            totals[name][1] += kernel
            per = {"forward, layers 2..": layers - 1, "backward": layers}.get(phase)
            per_layer = f"{(n - kernel) / per:.1f}" if per else ""
            cells.append(f"{n} ({kernel}) | {per_layer}")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{a}** ({b}) | " for a, b in totals.values()) + "|")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats (smoke run)")
    parser.add_argument("--top", type=int, default=12, help="the busiest functions to list")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.seq = 20, 256
    steps = trace(args.layers, args.seq)
    print(f"One CP training step, 2 gloo ranks, {args.layers}-layer Llama, {args.seq} tokens, balanced, rank 0; "
          "calls of cp-packing functions (of which the reference kernel's own), per layer without the kernel's:\n")
    print(_table(steps, args.layers))
    merged = collections.Counter()
    for phase in ("forward, layers 2..", "backward"):
        merged.update({f: c for f, c in steps["later"].get(phase, {}).items() if not f.startswith(KERNEL)})
    print(f"\nBusiest functions outside the kernel in forward (layers 2..) + backward of the later step:\n")
    print("| function | calls |\n|---|---|")
    for name, n in merged.most_common(args.top):
        print(f"| `{name}` | {n} |")
    later = steps["later"]
    in_model = sum(c for phase in ("forward, layer 1", "forward, layers 2..", "backward")
                   for f, c in later.get(phase, {}).items() if not f.startswith(KERNEL))
    print(f"\ncp-packing calls per attention layer inside the model call (forward + backward, the later step, "
          f"without the kernel's): {in_model / args.layers:.1f}")
    layer, kernel = overhead_us(args.repeats)
    print(f"\nPer-layer Python overhead at cp=1 (do-nothing kernel): {layer - kernel:.1f} us "
          f"(layer call {layer:.1f} us, kernel alone {kernel:.1f} us, median of {args.repeats} x 20 calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
