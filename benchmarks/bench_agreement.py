"""Benchmark the per-step cost of cp-packing's agreements as a fraction of a CP training step.

Run:  .venv/bin/python benchmarks/bench_agreement.py            (full: S=2048, 3 layers, cp 2 and 4, 10 steps)
      .venv/bin/python benchmarks/bench_agreement.py --quick    (smoke run: S=512, 2 layers, cp 2, 3 steps)
      .venv/bin/python benchmarks/bench_agreement.py --agree-only 5   (``agree`` alone, back to back, 5 runs)

Every cp-packing call that communicates starts with ONE ``cp_packing.agreement.agree`` (a small record per rank
posted to and read from the job's c10d store). This script runs ``cp`` forked gloo ranks (``cp_packing.testing.run_distributed``, one
intra-op thread each) and times training steps of a tiny random-init HF Llama (``cp_packing.tools.train``'s model
builder and synthetic batches: one row of ``--seq`` tokens, lognormal documents, up to 10% padding), where a step is

    distribute_batch(src=None, layout="auto")  ->  cp_model_inputs  ->  model forward (cp_packing HF attention in
    every layer)  ->  packed_cross_entropy(sharded=the prepared step)  ->  backward

(no gradient all-reduce, no optimizer step: both would only make the step longer and the fraction smaller). Every
step draws a new batch outside the timed region and is bracketed by ``dist.barrier()`` on both sides; its time is
rank 0's (it covers the slowest rank). After ``--warmup`` untimed steps, medians over ``--steps``; a fraction is the
median over the steps of (agreements / step) within each step, so drift in a shared machine's load cancels out.

The agreements, measured three ways:
- ``in step``: every ``agree`` the library calls is wrapped (in ``cp_packing.distributed``, ``.loss`` and
  ``.attention.dispatch``, the modules that call it) and its wall time summed per step; the worst rank. It includes
  waiting for the other ranks to arrive (e.g. the loss's agreement waits for the slowest rank's forward), time a real
  collective right after it would wait anyway, so it is an upper bound.
- ``bare``: right after each step, behind a barrier, the same agreements (same group, call, fields and payload as
  recorded in the step) are replayed back to back: the cost of the exchanges themselves; the worst rank.
- ``back to back``: after the steps, ``agree`` alone, 200 passing calls then 40 failing ones (a field that differs:
  every rank raises AgreementError and acknowledges the verdict), ms per call; the worst rank.

Counts: the store exchange (``agreement._exchange``) is wrapped too, and forward hooks count the attention layers run. The
run fails (exit 1) unless every step made exactly one agreement each in ``distribute_batch`` and
``context_parallel_attention`` (2 exchanges, one store exchange each: the loss on the prepared step is local math,
``packed_cross_entropy(..., sharded=inputs["cp_sharded"])``), and the
attention ran once per layer: layers 2..N reuse the first layer's agreement (cached on the shard).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

EXPECTED_CALLS = ("distribute_batch", "context_parallel_attention")


class _Recorder:
    """Wraps ``agree`` where the library calls it, and its store exchange; records what a step did."""

    def __init__(self):
        self.agreements: list[tuple[str, float, tuple, dict]] = []  # (call, seconds, args, kwargs)
        self.exchanges = 0
        self.attention_calls = 0

    def reset(self) -> None:
        self.agreements, self.exchanges, self.attention_calls = [], 0, 0

    def install(self) -> None:
        from cp_packing import agreement

        real_exchange = agreement._exchange

        def timed_exchange(channel, data, call, group_name):
            t0 = time.perf_counter()
            try:
                return real_exchange(channel, data, call, group_name)
            finally:
                self.exchanges += 1
                self.agreements.append((call, time.perf_counter() - t0, (channel, data, call, group_name), {}))

        agreement._exchange = timed_exchange  # every agreement (agree, fail_together) goes through one exchange
        self.replay = real_exchange

    def hook(self, module, inputs, output) -> None:
        self.attention_calls += 1


def _rank(rank: int, world: int, cfg: dict) -> dict:
    from cp_packing.distributed import distribute_batch
    from cp_packing.hf import cp_model_inputs, register_cp_attention
    from cp_packing.loss import packed_cross_entropy
    from cp_packing.tools.train import build_model, synthetic_batch

    torch.set_num_threads(1)
    args = cfg["args"]
    model = build_model(args, register_cp_attention()).train()
    rec = _Recorder()
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(rec.hook)
    rec.install()
    group = dist.group.WORLD
    keys = ("input_ids", "labels", "doc_ids")

    out = {"step": [], "agree_in_step": [], "agree_bare": [], "calls": [], "by_call": [], "exchanges": [],
           "attention": [], "bare_exchanges": [], "T_local": None, "layout": None, "checked": []}
    for step in range(cfg["warmup"] + cfg["steps"]):
        batch = synthetic_batch(args, step, 0)
        payload = {k: batch[k] for k in keys}
        rec.reset()
        dist.barrier()
        t0 = time.perf_counter()
        local, sharded = distribute_batch(payload, None, group=group, src=None, layout="auto")
        inputs = cp_model_inputs(local, sharded, group=group)
        logits = model(**inputs).logits[0]
        loss = packed_cross_entropy(logits, local["labels"][0], sharded=inputs["cp_sharded"])  # local math
        model.zero_grad(set_to_none=True)
        loss.backward()
        dist.barrier()
        step_s = time.perf_counter() - t0
        recorded = list(rec.agreements)
        calls, exchanges, attention = [a[0] for a in recorded], rec.exchanges, rec.attention_calls

        # the same agreements again, back to back, behind a barrier: the exchanges alone
        rec.reset()
        dist.barrier()
        t0 = time.perf_counter()
        for _call, _s, a, kw in recorded:
            rec.replay(*a, **kw)
            rec.exchanges += 1
        bare_s = time.perf_counter() - t0
        bare_exchanges = rec.exchanges

        checks = [a[1] for a in recorded if a[0] in ("attention layer", "attention backward")]
        if checks:  # a checked step (the first CHECKED_STEPS of the group): its per-layer agreements
            out["checked"].append((step_s, sum(checks), len(checks)))
        if step >= cfg["warmup"]:
            out["step"].append(step_s)
            out["agree_in_step"].append(sum(a[1] for a in recorded))
            out["agree_bare"].append(bare_s)
            out["calls"].append(calls)
            out["by_call"].append({c: sum(a[1] for a in recorded if a[0] == c) for c in calls})
            out["exchanges"].append(exchanges)
            out["attention"].append(attention)
            out["bare_exchanges"].append(bare_exchanges)
            out["T_local"] = sharded.num_local_tokens
            out["layout"] = sharded.layout
    out["pass_ms"], out["fail_ms"] = _back_to_back(rank, group, *cfg["micro"])
    return out


def _back_to_back(rank: int, group, passing: int, failing: int) -> tuple[float, float]:
    """ms per agreement, back to back behind a barrier: ``passing`` that agree, then ``failing`` that do not (each
    raises AgreementError on every rank; a failing one also waits until every rank has read the verdict)."""
    from cp_packing.agreement import AgreementError, agree

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(passing):
        agree(group, "bench pass", {"n": 1})
    pass_ms = 1e3 * (time.perf_counter() - t0) / passing
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(failing):
        try:
            agree(group, "bench fail", {"rank": rank})
        except AgreementError:
            pass
        else:
            raise AssertionError("an agreement on different values passed")
    return pass_ms, 1e3 * (time.perf_counter() - t0) / failing


def _agree_only(rank: int, world: int, micro: tuple[int, int]) -> tuple[float, float]:
    torch.set_num_threads(1)
    _back_to_back(rank, dist.group.WORLD, 50, 5)  # warm-up
    return _back_to_back(rank, dist.group.WORLD, *micro)


def _median_ms(values) -> float:
    return 1e3 * statistics.median(values)


def run(cp: int, args, steps: int, warmup: int, micro: tuple[int, int]) -> dict:
    from cp_packing.testing import run_distributed

    results = run_distributed(_rank, cp, {"args": args, "steps": steps, "warmup": warmup, "micro": micro},
                              timeout=600)
    r0 = results[0]
    worst = lambda key: [max(r[key][i] for r in results) for i in range(steps)]  # noqa: E731
    problems = []
    for r, res in enumerate(results):
        for i in range(steps):
            counts = Counter(res["calls"][i])
            if sorted(counts.elements()) != sorted(EXPECTED_CALLS):
                problems.append(f"cp={cp} rank {r} step {i}: agreements {dict(counts)}, expected one each of "
                                f"{', '.join(EXPECTED_CALLS)}")
            if res["exchanges"][i] != len(res["calls"][i]):
                problems.append(f"cp={cp} rank {r} step {i}: {res['exchanges'][i]} store exchanges for "
                                f"{len(res['calls'][i])} agreements")
            if res["attention"][i] != args.layers:
                problems.append(f"cp={cp} rank {r} step {i}: attention ran {res['attention'][i]} times, expected one "
                                f"per layer ({args.layers})")
            if res["bare_exchanges"][i] != len(res["calls"][i]):
                problems.append(f"cp={cp} rank {r} step {i}: the replay made {res['bare_exchanges'][i]} exchanges")
    in_step, bare = worst("agree_in_step"), worst("agree_bare")
    step_ms, in_step_ms, bare_ms = _median_ms(r0["step"]), _median_ms(in_step), _median_ms(bare)
    # fractions: the median of the per-step ratios (load drift on a shared machine hits both parts of a pair alike)
    in_step_frac = statistics.median(a / s for a, s in zip(in_step, r0["step"]))
    bare_frac = statistics.median(a / s for a, s in zip(bare, r0["step"]))
    return {
        "cp": cp, "layers": args.layers, "tokens": args.seq_len * args.batch, "T_local": r0["T_local"],
        "layout": r0["layout"], "agreements": statistics.median(len(c) for c in r0["calls"]),
        "attention": statistics.median(r0["attention"]), "step_ms": step_ms, "in_step_ms": in_step_ms,
        "bare_ms": bare_ms, "in_step_frac": in_step_frac, "bare_frac": bare_frac, "problems": problems,
        "step_range": (1e3 * min(r0["step"]), 1e3 * max(r0["step"])),
        "by_call": {c: _median_ms([max(r["by_call"][i].get(c, 0.0) for r in results) for i in range(steps)])
                    for c in EXPECTED_CALLS},
        "checked": r0["checked"],
        "pass_ms": max(r["pass_ms"] for r in results), "fail_ms": max(r["fail_ms"] for r in results),
        "micro": micro,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="smoke run: --seq 512 --cp 2 --steps 3")
    p.add_argument("--steps", type=int, default=None, help="timed steps per cp (default 10; quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 3)")
    p.add_argument("--seq", type=int, default=None, help="tokens in the step's one row (default 2048; quick 512)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64; 4 heads, 2 KV heads)")
    p.add_argument("--cp", type=int, nargs="+", default=None, help="CP sizes, one run each (default 2 4; quick 2)")
    p.add_argument("--agree-only", type=int, default=0, metavar="RUNS",
                   help="only the back-to-back agreements (1000 passing, 200 failing calls), RUNS runs per cp")
    a = p.parse_args(argv)
    if a.agree_only:
        from cp_packing.testing import run_distributed

        for cp in (a.cp or [2]):
            for _ in range(a.agree_only):
                per_rank = run_distributed(_agree_only, cp, (1000, 200), timeout=600)
                print(f"cp={cp}: back to back (worst rank): a passing agreement "
                      f"{max(p for p, _ in per_rank):.3f} ms, a failing one {max(f for _, f in per_rank):.3f} ms")
        return 0
    steps = a.steps if a.steps is not None else (3 if a.quick else 10)
    layers = a.layers if a.layers is not None else 3
    seq = a.seq if a.seq is not None else (512 if a.quick else 2048)
    cps = a.cp if a.cp is not None else ([2] if a.quick else [2, 4])
    for name, value in (("--steps", steps), ("--layers", layers), ("--seq", seq), ("--hidden", a.hidden)):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    for cp in cps:
        if cp < 2 or seq % cp:
            p.error(f"--cp {cp}: needs cp >= 2 (with one rank there is no agreement) dividing --seq {seq}")

    from cp_packing.tools.train import parse_args as train_args

    import transformers  # noqa: F401 - imported once here, inherited by the forked ranks

    args = train_args(["--seq-len", str(seq), "--batch", "1", "--layers", str(layers), "--hidden", str(a.hidden),
                       "--heads", "4", "--kv-heads", "2", "--vocab", "256"])
    args.dtype = "float32"
    print(f"agreement cost per step: tiny Llama ({layers} layers, hidden {a.hidden}, vocab 256), 1 x {seq} tokens, "
          f"float32, gloo on CPU, 1 thread per rank; {a.warmup} warm-up + {steps} timed steps", flush=True)
    rows = []
    for cp in cps:
        rows.append(run(cp, args, steps, a.warmup, (20, 5) if a.quick else (200, 40)))
        print(f"  cp={cp} done", flush=True)

    print()
    print("| cp | layers | tokens/rank | layout | agreements/step | attention layers/step | step ms | "
          "agree in step ms | in step / step | agree bare ms | bare / step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cp']} | {r['layers']} | {r['T_local']} | {r['layout']} | {r['agreements']:g} | "
              f"{r['attention']:g} | {r['step_ms']:.1f} | {r['in_step_ms']:.2f} | "
              f"{100 * r['in_step_frac']:.1f}% | {r['bare_ms']:.2f} | {100 * r['bare_frac']:.1f}% |")
    print()
    for r in rows:
        by_call = ", ".join(f"{c} {ms:.2f}" for c, ms in r["by_call"].items())
        print(f"cp={r['cp']}: step time over the timed steps {r['step_range'][0]:.1f}-{r['step_range'][1]:.1f} ms; "
              f"agreements in step by call (median ms, worst rank): {by_call}")
    for r in rows:
        print(f"cp={r['cp']}: back to back (worst rank): a passing agreement {r['pass_ms']:.3f} ms, a failing one "
              f"{r['fail_ms']:.3f} ms ({r['micro'][0]} and {r['micro'][1]} calls)")
    for r in rows:
        if r["checked"]:
            per = statistics.median(t / n for _, t, n in r["checked"])
            frac = statistics.median(t / s for s, t, _ in r["checked"])
            n = statistics.median(n for _, _, n in r["checked"])
            print(f"cp={r['cp']}: per-layer checks (check_layers, the first steps): {n:g} per step (forward and "
                  f"backward of layers 2..), {1e3 * per:.2f} ms each, {100 * frac:.1f}% of a checked step")
    problems = [msg for r in rows for msg in r["problems"]]
    if problems:
        print("FAIL: the agreement counts are not one per call per step:", file=sys.stderr)
        for msg in problems[:20]:
            print("  " + msg, file=sys.stderr)
        return 1
    later = ("(one layer: run --layers 2+ to see the reuse)" if layers == 1 else "layer 2 added none" if layers == 2
             else f"layers 2..{layers} added none")
    print(f"counts ok: every step made {len(EXPECTED_CALLS)} agreements (one each in {', '.join(EXPECTED_CALLS)}; "
          f"one store exchange each); attention ran once per layer, {later}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
