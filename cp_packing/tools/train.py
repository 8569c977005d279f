"""Train a tiny causal LM with context parallelism on synthetic neat-packed documents.

    torchrun --nproc-per-node 2 -m cp_packing train                   # CP over every rank (NCCL on GPUs, else gloo)
    torchrun --nproc-per-node 4 -m cp_packing train --cp 2            # DP x CP = 2 x 2, DeviceMesh ("dp", "cp")
    python -m cp_packing train --nproc 2 --steps 5 --check-parity     # no torchrun: forks a gloo group on CPU

Each step, CP rank 0 of every DP replica draws a batch of ``--batch`` rows of ``--seq-len`` tokens, packed with
documents of long-tailed (lognormal) lengths and up to 10% row padding (``cp_packing.testing.synthetic_doc_ids``);
each document is an arithmetic progression of token ids (mod the vocabulary), so the loss has something to learn.
Labels are shifted on the global stream (``cp_packing.next_token_labels``); for ``--layout zigzag`` every document
is padded to a multiple of ``2*cp`` (``cp_packing.padding.pad_segments``, pad tokens get label -100).
``cp_packing.distributed.distribute_batch`` ships each CP rank its own tokens and metadata (``--local-data``: every
rank builds the batch and shards it itself), the model (a random-init HF Llama or Qwen3 with
``attn_implementation="cp_packing"``) runs ``cp_packing.hf.cp_model_inputs``, the loss is
``cp_packing.loss.packed_cross_entropy`` (local sum / GLOBAL count), gradients are all-reduced with SUM over the CP
group and then the DP group, and AdamW steps.

Rank 0 prints a progress bar (tqdm when installed) and per-step lines with the global loss, step time, tokens/s
(real tokens, all ranks), peak memory (CUDA max allocated, else the largest RSS of a rank) and the CP
attention-cost imbalance: causal cost of a rank = sum over its tokens of (position in
segment + 1); imbalance = busiest / mean over the CP ranks (the worst DP replica).

``--check-parity``: for the first ``--parity-steps`` steps every rank also trains a copy of the model WITHOUT
context parallelism (HF's own sdpa attention with a block-diagonal 4-D mask, on the whole batch of every DP
replica), and compares the loss and every gradient with the CP run before the optimizer steps. Rank 0 prints the
largest differences and PASS/FAIL; the exit status is 1 on FAIL or on an error (printed with its traceback by the
rank that raised it), 2 on a usage error (options that do not fit the world: one line on rank 0).
"""

from __future__ import annotations

import argparse
import copy
import functools
import resource
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_packing.cost import causal_cost
from cp_packing.distributed import distribute_batch
from cp_packing.hf import cp_model_inputs, register_cp_attention
from cp_packing.loss import next_token_labels, packed_cross_entropy, reduce_loss_for_logging
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.testing import rank_device, synthetic_doc_ids
from cp_packing.tools import launch, rank0_parser

LAYOUT_CHOICES = ("contiguous", "zigzag", "balanced", "auto")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (loss, gradients) parity tolerances, relative to max(1, |loss|) and to the largest reference gradient.
PARITY_TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (3e-2, 2e-1), torch.float16: (1e-2, 1e-1)}


# ---------------------------------------------------------------------------------------------------- data


def synthetic_batch(args, step: int, dp_rank: int, cp_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The global batch of one DP replica at one step (every rank that asks gets the same tensors).

    Returns ``{"doc_ids", "input_ids", "labels", "real"}``, each ``[B, S]`` (``S = --seq-len``; for zigzag the
    padded length ``S'``, a multiple of ``2*cp``). ``real`` is False on padding and on zigzag pad tokens.
    """
    seed = args.seed * 1_000_003 + step * 1009 + dp_rank
    B, S, V = args.batch, args.seq_len, args.vocab
    doc = synthetic_doc_ids("lognormal", B, S, seed=seed, median=args.mean_doc_len, sigma=args.doc_len_sigma,
                            pad=0.1)
    # Every document: an arithmetic progression of token ids (mod V) with its own start and stride.
    flat = doc.reshape(-1)
    t = torch.arange(B * S)
    is_start = torch.ones(B * S, dtype=torch.bool)
    is_start[1:] = (flat[1:] != flat[:-1]) | (t[1:] % S == 0)
    seg = torch.cumsum(is_start, 0) - 1  # [T] segment of every token
    seg_start = t[is_start]
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, V, (seg_start.numel(),), generator=g)
    stride = torch.randint(1, 8, (seg_start.numel(),), generator=g)
    ids = ((start[seg] + stride[seg] * (t - seg_start[seg])) % V).where(flat != 0, 0).view(B, S)
    labels = next_token_labels(ids, doc)  # on the GLOBAL stream, before any padding or sharding
    real = doc != 0
    if args.layout == "zigzag":
        from cp_packing.padding import pad_segments

        padded = pad_segments(doc, multiple=2 * cp_size, tensors={"input_ids": ids, "labels": labels})
        doc, ids, labels, real = padded.doc_ids, padded.tensors["input_ids"], padded.tensors["labels"], ~padded.is_pad
    out = {"doc_ids": doc, "input_ids": ids, "labels": labels, "real": real}
    return {k: v.to(device) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------- model


def build_model(args, attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, 2 * args.seq_len),
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    cfg = LlamaConfig(**common) if args.model == "llama" else Qwen3Config(head_dim=args.hidden // args.heads, **common)
    torch.manual_seed(args.seed)  # the same weights on every rank
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
                      for p in model.parameters()])


def _all_reduce_grads(model, groups) -> None:
    """SUM every gradient over each group in turn (CP, then DP): ONE flat all-reduce per group."""
    groups = [g for g in groups if g is not None and dist.get_world_size(g) > 1]
    if not groups:
        return
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    for g in groups:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=g)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def reference_loss(ref_model, batches: list[dict]) -> torch.Tensor:
    """Loss of the union of ``batches`` without CP (HF sdpa, block-diagonal 4-D mask, per-document positions)."""
    total = None
    count = 0
    for batch in batches:
        doc = batch["doc_ids"]
        B, S = doc.shape
        params = packed_seq_params_from_doc_ids(doc.cpu())
        cu = params.cu_seqlens.to(torch.int64)
        t = torch.arange(B * S)
        seg = torch.searchsorted(cu, t, right=True) - 1  # [T] segment of every token
        pos = (t - cu[seg]).view(B, S)
        seg = seg.view(B, S)
        s = torch.arange(S)
        allowed = (seg[:, :, None] == seg[:, None, :]) & (s[:, None] >= s[None, :])[None]  # [B, S, S]
        dtype = next(ref_model.parameters()).dtype
        mask = torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~allowed[:, None], torch.finfo(dtype).min)
        dev = doc.device
        logits = ref_model(input_ids=batch["input_ids"], position_ids=pos.to(dev), attention_mask=mask.to(dev),
                           use_cache=False).logits
        ce = F.cross_entropy(logits.float().reshape(B * S, -1), batch["labels"].reshape(-1), ignore_index=-100,
                             reduction="sum")
        total = ce if total is None else total + ce
        count += int((batch["labels"] != -100).sum())
    return total / max(count, 1)


# ---------------------------------------------------------------------------------------------------- training


@dataclass
class Groups:
    cp: object
    dp: object | None
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int


def make_groups(world: int, cp: int, device: torch.device) -> Groups:
    if cp == world:
        return Groups(dist.group.WORLD, None, cp, dist.get_rank(), 1, 0)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return Groups(mesh["cp"].get_group(), mesh["dp"].get_group(), cp, mesh.get_local_rank("cp"), world // cp,
                  mesh.get_local_rank("dp"))


class _Progress:
    """A tqdm bar on a terminal when tqdm is installed (rank 0 only), else plain lines (logs, pipes, CI)."""

    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stdout.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="train", dynamic_ncols=True, file=sys.stdout)
            except ImportError:
                pass

    def step(self, line: str, postfix: dict, log: bool) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
            if log:
                self.bar.write(line)
        elif log:
            print(line, flush=True)

    def write(self, line: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class UsageError(Exception):
    """Options that do not fit the world they run on (found after the ranks start): exit 2, one line on rank 0.
    Every rank sees it alike (the same options and world). Not a ValueError, so a library ValueError is never
    mistaken for one."""


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA max allocated on a GPU, else the largest resident set size so far."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def train(args, rank: int, world: int, device: torch.device) -> int:
    if world % args.cp:
        raise UsageError(f"--cp {args.cp} does not divide the world size {world}; pick a divisor")
    groups = make_groups(world, args.cp, device)
    cp = groups.cp_size
    if args.layout != "zigzag" and (args.batch * args.seq_len) % cp:
        raise UsageError(
            f"--batch {args.batch} x --seq-len {args.seq_len} = {args.batch * args.seq_len} tokens is not a multiple "
            f"of cp={cp}; every CP rank must hold the same number of tokens: pick --seq-len a multiple of {cp}"
        )
    dtype = DTYPES[args.dtype]
    name = register_cp_attention()
    model = build_model(args, name).to(device=device, dtype=dtype).train()
    ref_model = None
    parity_steps = min(args.parity_steps, args.steps) if args.check_parity else 0
    if parity_steps:
        ref_model = copy.deepcopy(model)
        ref_model.set_attn_implementation("sdpa")
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=args.lr, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    is_main = rank == 0
    if is_main:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"cp-packing train: world={world} dp={groups.dp_size} cp={cp} layout={args.layout} device={device} "
              f"backend={dist.get_backend()} dtype={args.dtype} model={args.model} ({n_params / 1e6:.2f}M params) "
              f"batch={args.batch}x{args.seq_len} attention backend={args.attn_backend}", flush=True)

    progress = _Progress(args.steps, is_main)
    log_every = args.log_every or max(1, args.steps // 20)
    history = []
    worst_loss, worst_grad, first_failure = 0.0, 0.0, None
    loss_tol, grad_tol = PARITY_TOL[dtype]
    for step in range(args.steps):
        # ---- data: CP rank 0 of each DP replica builds the batch and scatters it (or every rank shards its own)
        is_src = groups.cp_rank == 0
        batch = None
        if args.local_data or is_src:
            batch = synthetic_batch(args, step, groups.dp_rank, cp, device)
        sync(device)
        t0 = time.perf_counter()
        payload = None if batch is None else {k: batch[k] for k in ("input_ids", "labels", "doc_ids", "real")}
        local, sharded = distribute_batch(payload, None, group=groups.cp, src=None if args.local_data else 0,
                                          layout=args.layout)

        # ---- forward / backward with CP
        inputs = cp_model_inputs(local, sharded, group=groups.cp, backend=args.attn_backend, kernel=args.kernel)
        logits = model(**inputs).logits[0]  # [T_local, V]
        share = packed_cross_entropy(logits, local["labels"][0], group=groups.cp, dp_group=groups.dp)
        opt.zero_grad(set_to_none=True)
        share.backward()
        if not args.inject_fault:  # (the fault: a trainer that forgets the CP gradient reduction)
            _all_reduce_grads(model, [groups.cp, groups.dp])  # the loss contract: SUM over CP (and DP)
        loss = float(reduce_loss_for_logging(share, group=groups.cp, dp_group=groups.dp))

        # ---- parity with a non-CP copy, before either optimizer steps
        if step < parity_steps:
            every = [synthetic_batch(args, step, r, cp, device) for r in range(groups.dp_size)]
            ref_opt.zero_grad(set_to_none=True)
            ref_t = reference_loss(ref_model, every)
            ref_t.backward()
            ref = float(ref_t.detach())
            d_loss = abs(loss - ref)
            g_cp, g_ref = _flat_grads(model).float(), _flat_grads(ref_model).float()
            d_grad = float((g_cp - g_ref).abs().max())
            scale = float(g_ref.abs().max())
            ok = d_loss <= loss_tol * max(1.0, abs(ref)) and d_grad <= grad_tol * scale + 1e-7
            worst_loss, worst_grad = max(worst_loss, d_loss), max(worst_grad, d_grad / max(scale, 1e-30))
            if not ok and first_failure is None:
                first_failure = step
            progress.write(f"parity step {step}: loss cp={loss:.6f} ref={ref:.6f} |diff|={d_loss:.2e}; "
                           f"grads max|diff|={d_grad:.2e} (max|grad|={scale:.2e}) {'ok' if ok else 'MISMATCH'}")
            ref_opt.step()
        opt.step()
        sync(device)
        dt = time.perf_counter() - t0

        # ---- metrics: one small all-gather over the world of (causal cost, real tokens) per rank
        run_cu = sharded.cu_seqlens.to(torch.int64)
        run_start = sharded.token_index.index_select(0, run_cu[:-1].to(sharded.token_index.device))
        cost = causal_cost(sharded.global_params.cu_seqlens, run_start, run_cu[1:] - run_cu[:-1]).sum()
        real_tokens = local["real"].sum()
        stats = torch.stack([cost.to(torch.float64), real_tokens.cpu().to(torch.float64),
                             torch.tensor(float(peak_memory_bytes(device)), dtype=torch.float64)]).to(device)
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        stats = torch.stack(gathered).cpu()  # [world, 3]
        cost_by_rank = stats[:, 0].view(groups.dp_size, cp) if groups.dp is not None else stats[:, 0].view(1, cp)
        imbalance = float((cost_by_rank.max(1).values / cost_by_rank.mean(1).clamp_min(1e-30)).max())
        tokens_per_s = float(stats[:, 1].sum()) / dt
        peak_mib = float(stats[:, 2].max()) / 2**20
        history.append((loss, tokens_per_s, imbalance, sharded.layout))
        progress.step(
            f"step {step + 1:>4}/{args.steps}  loss {loss:.4f}  time {dt * 1e3:,.0f} ms  tok/s {tokens_per_s:,.0f}  "
            f"imbalance {imbalance:.3f}  peak mem {peak_mib:,.0f} MiB  layout {sharded.layout}",
            {"loss": f"{loss:.4f}", "tok/s": f"{tokens_per_s:,.0f}", "imb": f"{imbalance:.3f}"},
            log=(step + 1) % log_every == 0 or step == 0 or step + 1 == args.steps,
        )
    progress.close()

    code = 0
    if is_main:
        n = len(history)
        print(f"done: {n} steps, loss {history[0][0]:.4f} -> {history[-1][0]:.4f}, "
              f"mean tok/s {sum(h[1] for h in history[1:] or history) / max(1, len(history[1:] or history)):,.0f}, "
              f"mean imbalance {sum(h[2] for h in history) / n:.3f}", flush=True)
    if parity_steps:
        verdict = "PASS" if first_failure is None else "FAIL"
        code = 0 if first_failure is None else 1
        if is_main:
            print(f"parity ({parity_steps} steps, cp={cp} vs cp=1, {args.dtype}): max |loss diff| = {worst_loss:.3e} "
                  f"(tol {loss_tol:g} x max(1, |loss|)), max grad diff / max|grad| = {worst_grad:.3e} "
                  f"(tol {grad_tol:g}): {verdict}", flush=True)
    return code


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------- entry


def parse_args(argv=None):
    from cp_packing.attention.kernels import KERNELS

    p = rank0_parser(argparse.ArgumentParser(prog="python -m cp_packing train", description=__doc__.split("\n\n")[0],
                                             formatter_class=argparse.RawDescriptionHelpFormatter,
                                             epilog=__doc__.split("\n\n", 1)[1]))
    p.add_argument("--nproc", type=int, default=None,
                   help="without torchrun: spawn this many CPU processes in a gloo group (default 2)")
    p.add_argument("--cp", type=int, default=None, help="CP group size (default: the world size; else DP x CP)")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, default="auto",
                   help="token placement over CP ranks (default auto: the cheapest valid layout per batch)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    p.add_argument("--batch", type=int, default=2, help="rows per DP replica per step (default 2)")
    p.add_argument("--mean-doc-len", type=float, default=None,
                   help="median document length of the lognormal (default seq-len / 8)")
    p.add_argument("--doc-len-sigma", type=float, default=1.0, help="lognormal sigma of document lengths")
    p.add_argument("--model", choices=("llama", "qwen3"), default="llama")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attn-backend", choices=("auto", "allgather", "ring_flash_attn", "ulysses"), default="auto")
    p.add_argument("--kernel", default="auto", choices=("auto", *KERNELS),
                   help="varlen kernel of the allgather backend (default auto: the best one available)")
    p.add_argument("--local-data", action="store_true",
                   help="every CP rank builds the batch and shards it locally (default: CP rank 0 scatters it)")
    p.add_argument("--check-parity", action="store_true", help="compare the first steps with a non-CP model")
    p.add_argument("--parity-steps", type=int, default=2)
    p.add_argument("--log-every", type=int, default=None, help="print a line every N steps (default steps/20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inject-fault", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "batch", "hidden", "layers", "heads", "kv_heads", "vocab", "parity_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("nproc", "cp", "log_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.mean_doc_len is None:
        args.mean_doc_len = max(1.0, args.seq_len / 8)
    if args.mean_doc_len <= 0:
        p.error(f"--mean-doc-len must be > 0, got {args.mean_doc_len}")
    if args.doc_len_sigma < 0:
        p.error(f"--doc-len-sigma must be >= 0, got {args.doc_len_sigma}")
    if args.attn_backend == "ring_flash_attn" and args.layout == "auto":
        args.layout = "contiguous"  # ring-flash-attn has kernels for contiguous and zigzag; contiguous fits any batch
    if args.attn_backend == "ring_flash_attn" and args.layout == "balanced":
        p.error("--attn-backend ring_flash_attn has no kernel for --layout balanced; use contiguous, zigzag or auto")
    return args


def _finish(args, world: int, device: torch.device):
    from cp_packing.attention.kernels import available_kernels

    args = copy.copy(args)
    if args.cp is None:
        args.cp = world
    if args.dtype is None:
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    if args.kernel != "auto" and args.kernel not in available_kernels(device):
        raise UsageError(f"--kernel {args.kernel} is not available on {device.type} here (available: "
                         f"{', '.join(available_kernels(device))}); pick one of them or --kernel auto")
    return args


def _run(args, rank: int, world: int) -> int:
    device = rank_device()
    try:
        return train(_finish(args, world, device), rank, world, device)
    except UsageError as e:  # options that do not fit the world, the same on every rank: one line, exit 2
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception:  # noqa: BLE001 - any other error (a library ValueError too): on the rank that raised it, exit 1
        print(f"error on rank {rank} of {world}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1


def main(argv=None) -> int:
    """``python -m cp_packing train``: returns the exit status (0 ok, 1 error or parity FAIL, 2 usage error)."""
    args = parse_args(argv)
    import transformers  # noqa: F401 - imported once here, inherited by forked ranks

    return launch(functools.partial(_run, args), args.nproc)


if __name__ == "__main__":
    sys.exit(main())
