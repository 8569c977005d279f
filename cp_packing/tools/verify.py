"""Check context-parallel attention against full attention on YOUR cluster: every layout, backend and kernel.

    torchrun --nproc-per-node 4 -m cp_packing verify                  # NCCL + CUDA (gloo + CPU without GPUs)
    torchrun --nproc-per-node 8 -m cp_packing verify --dtype bfloat16 float16 --trials 5 --seq-len 4096
    python -m cp_packing verify --nproc 2                             # no torchrun: forks a gloo group on CPU

For each trial, every rank draws the same seeded packed batch (``trial_doc_ids``: lognormal document lengths, row 0
opening with a document of 3/4 of the row, row padding, and a document across every shard edge of the contiguous
layout, with one row more than ``--batch`` when cp divides it, where contiguous shards would be whole rows; for
``zigzag`` every document padded to a multiple of ``2*cp`` with ``cp_packing.pad_segments``) and the same random
q/k/v/dout. Every rank computes full causal attention per
segment on the whole global stream (the pure-torch varlen reference in float32, or float64 for float64 runs) and
its gradients, shards them, and compares its context-parallel output and q/k/v gradients. Rank 0 prints one row
per (layout, backend, kernel, dtype) with the largest errors over all ranks and trials, and PASS/FAIL against
tolerances scaled to the dtype; the process exits 1 on any FAIL (2 on a usage error). A NaN anywhere in an
output or gradient counts as an infinite error (FAIL). Combinations that cannot run here or that a backend refuses
by design (ring-flash-attn not installed, a CUDA-only kernel on CPU, float32 through the real flash-attn, which runs
fp16/bf16 only, float32 zigzag through ring-flash-attn, whose float32 backward is wrong upstream, Ulysses with a CP
size that does not divide ``--heads``, hybrid below cp 4) are listed as SKIP with the reason. Hybrid rows run the
smallest ``ulysses_size`` in ``2 .. cp - 1`` that divides cp and ``--heads`` (:func:`hybrid_size`).

The whole world is the CP group (cp_size = world size).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import traceback

import torch
import torch.distributed as dist

from cp_packing.attention import kernels
from cp_packing.attention.dispatch import context_parallel_attention
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.testing import rank_device, synthetic_doc_ids
from cp_packing.tools import launch, rank0_parser

LAYOUTS = ("contiguous", "zigzag", "balanced", "local")
BACKENDS = ("allgather", "exchange", "ulysses", "hybrid", "ring_flash_attn")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (out, grads): PASS when max|err| <= tol * max(1, max|reference|). Half-precision inputs are rounded once, so the
# reference sees exactly the same inputs; what remains is the kernel's own rounding of P, out and the gradients.
TOLERANCES = {
    torch.float64: (1e-9, 1e-8),
    torch.float32: (1e-4, 5e-4),
    torch.float16: (5e-3, 1.5e-2),
    torch.bfloat16: (2e-2, 5e-2),
}


# ---------------------------------------------------------------------------------------------------- batches


def trial_shape(cp_size: int, batch: int, seq_len: int) -> tuple[int, int]:
    """``(rows, S)`` of a trial's map: ``S`` = ``seq_len`` rounded up to a multiple of ``cp_size``; one row more
    than ``batch`` when ``cp_size`` divides it (else every contiguous shard would be whole rows, and no query would
    need keys from another rank)."""
    rows = batch + 1 if cp_size > 1 and batch % cp_size == 0 else batch
    return rows, -(-seq_len // cp_size) * cp_size


def trial_doc_ids(layout: str, cp_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """The doc map of one trial, valid for ``layout`` (zigzag: every segment a multiple of 2*cp), in which every
    layout splits documents across ranks, so that wrong key metadata changes the output at every cp >= 2.

    Lognormal lengths (median S/6, so some documents are longer than a shard), up to 20% row padding, row 0 opening
    with a document of 3/4 of the row, and at every contiguous shard edge inside a row the same document (or
    padding run) on both sides. ``balanced`` keeps heavy documents whole where it can: when it splits none of that
    map (and ``local``, which keeps documents on their ranks where it can), the trial uses whole-row documents
    instead (``trial_shape`` makes the row count indivisible by cp, so equal token counts force a split).
    """
    rows, S = trial_shape(cp_size, batch, seq_len)
    doc_ids = synthetic_doc_ids("huge", rows, S, seed=seed, median=max(S / 6, 1.0), sigma=1.0, pad=0.2)
    flat = doc_ids.view(-1)
    T_local = rows * S // cp_size
    for edge in range(T_local, rows * S, T_local):
        if edge % S and flat[edge - 1] != 0:
            flat[edge] = flat[edge - 1]  # the document before the edge reaches across it
    if layout == "zigzag":
        from cp_packing.padding import pad_segments

        return pad_segments(doc_ids, multiple=2 * cp_size).doc_ids
    if layout in ("balanced", "local") and not splits_a_document(doc_ids, cp_size, layout):
        return torch.ones_like(doc_ids)
    return doc_ids


def splits_a_document(doc_ids: torch.Tensor, cp_size: int, layout: str) -> bool:
    """Whether some rank holds a run that starts inside its segment (its keys start on tokens before the run)."""
    params = packed_seq_params_from_doc_ids(doc_ids)
    for rank in range(cp_size):
        s = shard_packed_seq_params(params, cp_size=cp_size, cp_rank=rank, layout=layout)
        if bool((s.key_start < s.token_index[s.cu_seqlens[:-1].long()]).any()):
            return True
    return False


def inject_fault(sharded):
    """Deliberately wrong metadata (for testing this verifier): every run whose keys start before the run itself
    loses its first key. The result must FAIL."""
    first = sharded.token_index[sharded.cu_seqlens[:-1].long()]
    key_start = torch.where(sharded.key_start < first, sharded.key_start + 1, sharded.key_start)
    return dataclasses.replace(sharded, key_start=key_start)  # its cache entries are not reused: new metadata


# ------------------------------------------------------------------------------------------------------ checks


@dataclasses.dataclass
class Row:
    layout: str
    backend: str
    kernel: str
    dtype: torch.dtype
    skip: str | None = None
    err_out: float = 0.0
    err_grad: float = 0.0
    ref_out: float = 0.0
    ref_grad: float = 0.0
    error: str | None = None

    def status(self) -> str:
        if self.skip:
            return "SKIP"
        tol_out, tol_grad = TOLERANCES[self.dtype]
        ok = (
            self.error is None
            and math.isfinite(self.err_out)
            and math.isfinite(self.err_grad)
            and math.isfinite(self.ref_out)  # a non-finite reference would scale the tolerance to inf
            and math.isfinite(self.ref_grad)
            and self.err_out <= tol_out * max(1.0, self.ref_out)
            and self.err_grad <= tol_grad * max(1.0, self.ref_grad)
        )
        return "PASS" if ok else "FAIL"


def _ring_status(layout: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when the ring backend can run this combination here, else why not: the combinations that the
    capabilities table (``cp_packing.capabilities``) refuses are SKIP rows (with its reason), not FAIL rows."""
    from cp_packing.capabilities import backend_refusal, flash_attn_is_test_stub

    refusal = backend_refusal("ring_flash_attn", layout=layout)
    if refusal is None and layout == "zigzag" and dtype not in (torch.float16, torch.bfloat16):
        refusal = backend_refusal("ring_flash_attn", layout=layout, dtype=dtype)
    if refusal is not None:
        return refusal[1].split(";")[0] + " (refused)"
    try:
        from cp_packing.attention.ring import import_ring_flash_attn

        import_ring_flash_attn()
    except Exception as e:  # noqa: BLE001
        return f"ring-flash-attn not importable: {str(e).split(';')[0]}"
    refusal = backend_refusal("ring_flash_attn", layout=layout, dtype=dtype)  # after the import: which flash_attn
    if refusal is not None:
        return refusal[1].split(";")[0] + " (refused)"
    if device.type != "cuda" and not flash_attn_is_test_stub():
        return "ring-flash-attn runs on CUDA"
    return None


def hybrid_size(cp_size: int, heads: int) -> int | None:
    """The ``ulysses_size`` a hybrid row runs: the smallest ``U`` in ``2 .. cp - 1`` dividing ``cp_size`` and
    ``heads`` (Ulysses inside groups of ``U`` ranks, the all-gather across ``cp / U`` of them), else None."""
    return next((u for u in range(2, cp_size) if cp_size % u == 0 and heads % u == 0), None)


def plan_rows(layouts, backends, dtypes, device: torch.device, *, cp_size: int = 1, heads: int = 1) -> list[Row]:
    rows = []
    for layout in layouts:
        for dtype in dtypes:
            for backend in ("allgather", "exchange", "ulysses", "hybrid"):
                if backend not in backends:
                    continue
                for kernel in kernels.KERNELS:
                    row = Row(layout, backend, kernel, dtype)
                    if kernel not in kernels.available_kernels(device):
                        row.skip = f"kernel {kernel!r} not available on {device.type}"
                    elif kernel != "torch" and dtype not in (torch.float16, torch.bfloat16):
                        row.skip = f"kernel {kernel!r} runs fp16/bf16 only"
                    elif backend == "ulysses" and heads % cp_size:
                        row.skip = f"ulysses needs cp_size={cp_size} to divide --heads {heads} (refused)"
                    elif backend == "hybrid" and hybrid_size(cp_size, heads) is None:
                        row.skip = (f"hybrid needs a ulysses_size in 2..cp-1 dividing cp_size={cp_size} and --heads "
                                    f"{heads} (cp >= 4)")
                    rows.append(row)
            if "ring_flash_attn" in backends:
                row = Row(layout, "ring_flash_attn", "flash_attn", dtype)
                row.skip = _ring_status(layout, dtype, device)
                rows.append(row)
    return rows


def check_once(row: Row, args, rank: int, cp_size: int, device: torch.device, trial: int) -> None:
    """One trial of one row: update the row's max errors (this rank's view)."""
    seed = args.seed + 1000 * trial
    doc_ids = trial_doc_ids(row.layout, cp_size, args.batch, args.seq_len, seed).to(device)
    params = packed_seq_params_from_doc_ids(doc_ids)
    sharded = shard_packed_seq_params(params, cp_size=cp_size, cp_rank=rank, layout=row.layout)
    if args.inject_fault:
        sharded = inject_fault(sharded)
    T = doc_ids.numel()
    g = torch.Generator().manual_seed(seed + 1)
    H, H_kv, D = args.heads, args.kv_heads, args.head_dim
    shapes = ((T, H, D), (T, H_kv, D), (T, H_kv, D), (T, H, D))
    q, k, v, dout = (torch.randn(s, generator=g).to(device=device, dtype=row.dtype) for s in shapes)

    # Reference: full attention per segment on the whole stream, from the same (dtype-rounded) inputs.
    ref_dtype = torch.float64 if row.dtype == torch.float64 else torch.float32
    ref_in = [x.to(ref_dtype, copy=True).requires_grad_() for x in (q, k, v)]
    cu, max_len = params.cu_seqlens.to(device), params.max_seqlen
    ref = kernels.varlen_attention(*ref_in, cu, cu, max_len, max_len, causal=True, kernel="torch")
    (ref * dout.to(ref_dtype)).sum().backward()  # no out.backward(grad): that imports sympy on first use

    local = [sharded.shard(x).detach().requires_grad_() for x in (q, k, v)]
    U = hybrid_size(cp_size, args.heads) if row.backend == "hybrid" else None
    out = context_parallel_attention(*local, sharded, backend=row.backend, kernel=row.kernel, ulysses_size=U)
    (out * sharded.shard(dout)).sum().backward()

    # NaN -> inf before max: a NaN must FAIL, and Python's max(0.0, nan) is 0.0 (NaN compares False).
    def err(got, want):
        diff = got.detach().to(ref_dtype) - sharded.shard(want.detach())
        return float(torch.nan_to_num(diff.abs(), nan=math.inf).max()) if diff.numel() else 0.0

    def mag(want):
        return float(torch.nan_to_num(want.detach().abs(), nan=math.inf).max()) if want.numel() else 0.0

    row.err_out = max(row.err_out, err(out, ref))
    row.err_grad = max(row.err_grad, *(err(x.grad, r.grad) for x, r in zip(local, ref_in)))
    row.ref_out = max(row.ref_out, mag(ref))
    row.ref_grad = max(row.ref_grad, *(mag(r.grad) for r in ref_in))


def verify(args, rank: int, cp_size: int, device: torch.device) -> int:
    """Run every row; rank 0 prints the table. Returns the exit code (the same on every rank)."""
    dtypes = [DTYPES[name] for name in (args.dtype or (["bfloat16", "float32"] if device.type == "cuda" else ["float32"]))]
    rows = plan_rows(args.layouts, args.backends, dtypes, device, cp_size=cp_size, heads=args.heads)
    for row in rows:
        if row.skip:
            continue
        try:
            for trial in range(args.trials):
                check_once(row, args, rank, cp_size, device, trial)
        except Exception as e:  # noqa: BLE001 - reported in the table; deterministic errors hit every rank alike
            row.error = f"{type(e).__name__}: {e}"
            if args.verbose:
                traceback.print_exc()
    # Largest errors over ranks: one all-reduce (MAX) of [rows, 5].
    stats = torch.tensor(
        [[r.err_out, r.err_grad, r.ref_out, r.ref_grad, float(r.error is not None)] for r in rows],
        dtype=torch.float64, device=device,
    ).nan_to_num(nan=float("inf"))
    if cp_size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    for r, (eo, eg, ro, rg, failed) in zip(rows, stats.tolist()):
        r.err_out, r.err_grad, r.ref_out, r.ref_grad = eo, eg, ro, rg
        if failed and r.error is None:
            r.error = "failed on another rank"
    failures = sum(r.status() == "FAIL" for r in rows)
    if rank == 0:
        print_table(rows, cp_size, device, args)
        print(f"\n{failures} FAIL, {sum(r.status() == 'PASS' for r in rows)} PASS, "
              f"{sum(r.status() == 'SKIP' for r in rows)} SKIP")
    return 1 if failures else 0


def print_table(rows: list[Row], cp_size: int, device: torch.device, args) -> None:
    n_rows, S = trial_shape(cp_size, args.batch, args.seq_len)
    print(f"cp-packing verify: cp_size={cp_size}, device={device.type}, batch={n_rows}x{S}, "
          f"heads={args.heads}/{args.kv_heads}, head_dim={args.head_dim}, trials={args.trials}, seed={args.seed}"
          + ("  [--inject-fault]" if args.inject_fault else ""))
    header = ("layout", "backend", "kernel", "dtype", "max|err| out", "max|err| grads", "result")
    lines = []
    for r in rows:
        dtype = str(r.dtype).replace("torch.", "")
        if r.skip:
            lines.append((r.layout, r.backend, r.kernel, dtype, "-", "-", f"SKIP ({r.skip})"))
        else:
            status = r.status() + (f" ({r.error})" if r.error else "")
            lines.append((r.layout, r.backend, r.kernel, dtype, f"{r.err_out:.2e}", f"{r.err_grad:.2e}", status))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header[:-1])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    print(fmt.format(*header))
    print(fmt.format(*("-" * w for w in widths), "-" * 6))
    for line in lines:
        print(fmt.format(*line))


# ------------------------------------------------------------------------------------------------------ launch


def parse_args(argv=None):
    p = rank0_parser(argparse.ArgumentParser(prog="python -m cp_packing verify", description=__doc__.split("\n\n")[0],
                                             formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=None,
                   help="default: bfloat16 and float32 on CUDA, float32 on CPU")
    p.add_argument("--trials", type=int, default=3, help="random batches per row (default 3)")
    p.add_argument("--batch", type=int, default=2, help="rows per batch (default 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 64*cp on CPU, 1024*cp on CUDA)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="default 8 on CPU, 64 on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=None,
                   help="without torchrun: spawn this many CPU processes in a gloo group (default 2)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing rows")
    p.add_argument("--inject-fault", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("trials", "batch", "heads", "kv_heads", "seq_len", "head_dim"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}: a size of {value} tests nothing")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.nproc is not None and args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    return args


def _finish_args(args, cp_size: int, device: torch.device):
    if args.seq_len is None:
        args.seq_len = (1024 if device.type == "cuda" else 64) * cp_size
    if args.head_dim is None:
        args.head_dim = 64 if device.type == "cuda" else 8
    return args


def _run(args, rank: int, world: int) -> int:
    if args.inject_fault and world < 2:
        if rank == 0:
            print("error: --inject-fault needs at least 2 ranks (one rank holds whole documents: no key metadata "
                  "to break); run with --nproc 2 or more", file=sys.stderr, flush=True)
        return 2
    device = rank_device()
    return verify(_finish_args(args, world, device), rank, world, device)


def main(argv=None) -> int:
    """``python -m cp_packing verify``: returns the exit status (0 all PASS, 1 a FAIL or an error, 2 usage error)."""
    args = parse_args(argv)
    return launch(functools.partial(_run, args), args.nproc)


if __name__ == "__main__":
    sys.exit(main())
