"""Train a causal LM with context parallelism: a preset tiny model on synthetic documents, or YOUR local HF model
directory on YOUR local jsonl / parquet data, saved with ``save_pretrained`` at the end (and on SIGTERM).

    torchrun --nproc-per-node 2 -m cp_packing train                   # CP over every rank (NCCL on GPUs, else gloo)
    torchrun --nproc-per-node 4 -m cp_packing train --cp 2            # DP x CP = 2 x 2, DeviceMesh ("dp", "cp")
    python -m cp_packing train --nproc 2 --steps 5 --check-parity     # no torchrun: forks a gloo group on CPU
    torchrun --nproc-per-node 2 -m cp_packing train --model ./my-model --data ./train.jsonl --seq-len 1024 \\
        --steps 100 --output-dir ./trained                           # a local checkpoint on local data

Model (``--model``): a preset (``llama`` / ``qwen3``: tiny random-init, sized by --hidden/--layers/--heads/--kv-heads/
--vocab) or a local HF model directory (config + weights, and a tokenizer for text data; loaded with
``from_pretrained(..., local_files_only=True)``, never downloaded). Data (``--data``): a local ``.jsonl`` or
``.parquet`` file with a ``text`` column (tokenized with the model directory's tokenizer) or ``input_ids`` (optional
``labels``), see ``cp_packing.tools.data``; packed into ``--batch`` rows of ``--seq-len`` tokens per DP replica and
step by ``cp_packing.packing.pack_documents`` (epochs repeat, reshuffled, until ``--steps``). Without ``--data``:
synthetic lognormal-length documents whose tokens are arithmetic progressions (something to learn).

Each step, CP rank 0 of every DP replica ships each CP rank its tokens (``cp_packing.distribute_batch``;
``--local-data``: every rank shards locally); labels are shifted on the global stream; ``--layout zigzag`` pads every
document to a multiple of ``2*cp``; ``--layout auto`` picks per batch among the layouts ``--attn-backend`` runs
(``ring_flash_attn``: contiguous or zigzag, the cheaper; the others: every layout, ``cp_packing.cost.choose_layout``).
The loss is ``cp_packing.packed_cross_entropy`` (local sum / GLOBAL count); gradients are SUMmed over CP and DP
(``--fsdp``: FSDP2 over the flattened DP x CP mesh with SUM reduction); AdamW steps.

Rank 0 prints one plain line per logged step (a log file reads like the terminal): step, loss, step time, tokens/s
(real tokens, all ranks), imbalance (busiest / mean causal attention cost of the step's layout over the CP ranks,
worst DP replica: ``cp_packing.cost.layout_cost``) and peak memory (CUDA max allocated, else the largest RSS of a
rank). SIGTERM (a scheduler's preemption): every rank finishes its current step, the model is saved to
``--output-dir`` (gathered to rank 0 under FSDP) and the run exits with status 143.

``--check-parity``: for the first ``--parity-steps`` steps every rank also trains a copy of the model WITHOUT
context parallelism (HF sdpa with a block-diagonal 4-D mask on the whole batch of every DP replica) and compares the
loss and every gradient before the optimizer steps; PASS/FAIL. Exit status: 0 ok, 1 an error (its traceback from the
rank that raised it) or parity FAIL, 2 a usage error (one line on rank 0, before the first step: every option, the
model directory, the data file and its columns, sizes against the world), 143 stopped by SIGTERM after saving.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import resource
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_packing.cost import layout_cost
from cp_packing.distributed import distribute_batch
from cp_packing.hf import cp_model_inputs, model_windows, register_cp_attention
from cp_packing.layouts import LAYOUTS
from cp_packing.loss import next_token_labels, packed_cross_entropy, reduce_loss_for_logging
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.testing import rank_device, synthetic_doc_ids, under_torchrun
from cp_packing.tools import launch, rank0_parser

LAYOUT_CHOICES = (*LAYOUTS, "auto")
PRESETS = ("llama", "qwen3")
PRESET_SIZES = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 256}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (loss, gradients) parity tolerances, relative to max(1, |loss|) and to the largest reference gradient.
PARITY_TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (3e-2, 2e-1), torch.float16: (1e-2, 1e-1)}
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: stopped by SIGTERM, model saved


class UsageError(Exception):
    """Options that do not fit the model, the data or the world: exit 2, one line on rank 0, before the first step.
    Every rank finds it alike (the same options, files and world). Not a ValueError, so a library ValueError during
    training is never mistaken for one."""


# ---------------------------------------------------------------------------------------------------- setup


@dataclass
class Setup:
    """What every rank starts from, checked before any rank trains: the options, the world size, the model config
    (preset or read from the model directory), its tokenizer (or None) and the documents of ``--data`` (or None)."""

    args: argparse.Namespace
    world: int
    config: Any
    tokenizer: Any = None
    data: Any = None  # cp_packing.tools.data.Documents


def preset_config(args) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=max(4096, 2 * args.seq_len), attention_dropout=0.0, tie_word_embeddings=False)
    if args.model == "llama":
        return LlamaConfig(**common)
    return Qwen3Config(head_dim=args.hidden // args.heads, **common)


def model_dir_config(path: str) -> tuple[Any, Any]:
    """``(config, tokenizer or None)`` of a local HF model directory; a UsageError when it is not one."""
    from transformers import AutoConfig, AutoTokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--model {path!r} is not a HF model directory (no config.json); give a directory written "
                         f"by save_pretrained, or a preset: {', '.join(PRESETS)}")
    if not any(f.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))
               for f in os.listdir(path)):
        raise UsageError(f"--model {path!r} has a config.json but no weights (*.safetensors / pytorch_model*.bin)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, OSError, KeyError, ... on a bad config
        raise UsageError(f"--model {path!r}: its config.json does not load ({type(exc).__name__}: {exc})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer files (OSError/ValueError/TypeError by version): token ids only
        tokenizer = None
    return config, tokenizer


def prepare(args, world: int) -> Setup:
    """Every check that needs no process group: sizes against the world, the model, the tokenizer, the data (read
    and tokenized here), the output directory. Raises UsageError."""
    if under_torchrun() and args.nproc is not None:
        raise UsageError("--nproc is for runs without torchrun; torchrun sets the world size (--nproc-per-node)")
    cp = world if args.cp is None else args.cp
    if world % cp:
        raise UsageError(f"--cp {cp} does not divide the world size {world}; pick a divisor")
    if args.layout != "zigzag" and (args.batch * args.seq_len) % cp:
        raise UsageError(
            f"--batch {args.batch} x --seq-len {args.seq_len} = {args.batch * args.seq_len} tokens is not a multiple "
            f"of cp={cp}; every CP rank must hold the same number of tokens: pick --seq-len a multiple of {cp} "
            "(or --layout zigzag, which pads every document to a multiple of 2*cp)")
    config, tokenizer = _model_config(args)
    data = _documents(args, config, tokenizer, world // cp) if args.data is not None else None
    if args.output_dir is not None:
        _check_output_dir(args.output_dir)
    return Setup(args=args, world=world, config=config, tokenizer=tokenizer, data=data)


def _model_config(args) -> tuple[Any, Any]:
    """``(config, tokenizer or None)`` of ``--model``: a preset sized by the options (defaults filled in here), or
    a local directory (the preset sizes refused)."""
    given = [f"--{k.replace('_', '-')}" for k in PRESET_SIZES if getattr(args, k) is not None]
    if args.model in PRESETS:
        for k, v in PRESET_SIZES.items():
            setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
        if args.heads % args.kv_heads:
            raise UsageError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
        if args.hidden % args.heads:
            raise UsageError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
        return preset_config(args), None
    if not os.path.isdir(args.model):
        raise UsageError(f"--model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory")
    if given:
        raise UsageError(f"{', '.join(given)} size a preset model; --model {args.model!r} is a directory with its "
                         "own config: drop them")
    config, tokenizer = model_dir_config(args.model)
    args.vocab = config.vocab_size  # synthetic documents (no --data) draw ids below it
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and args.seq_len > max_pos:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings {max_pos}")
    return config, tokenizer


def _documents(args, config, tokenizer, dp_size: int):
    """The documents of ``--data`` (``cp_packing.tools.data``), checked to fill at least one step."""
    from cp_packing.tools.data import load_documents

    try:
        data = load_documents(args.data, tokenizer=tokenizer, vocab_size=config.vocab_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        first = next(iter(batch_stream(args, data, dp_size)), None)
    except (ValueError, TypeError) as exc:  # the packer's own checks
        raise UsageError(f"--data {args.data!r}: {exc}") from None
    if first is None:
        raise UsageError(f"--data {args.data!r} ({len(data.documents)} documents, {data.tokens:,} tokens) does not "
                         f"fill one step of {dp_size} DP replica(s) x --batch {args.batch} rows x --seq-len "
                         f"{args.seq_len}; lower --batch or --seq-len, or give more data")
    return data


def _check_output_dir(path: str) -> None:
    out = os.path.abspath(path)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--output-dir {path!r} is a file; give a directory")
    parent = out
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--output-dir {path!r} is not writable (nor is {parent!r}, where it would be created)")


def heads_of(config) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head dim)`` of a HF config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv, head_dim


def backend_layouts(backend: str, kernel: str, cp: int, device: torch.device, dtype: torch.dtype,
                    heads: tuple[int, int, int]) -> tuple[str, ...]:
    """The layouts ``backend`` (with ``kernel``) runs here for this model, asked of
    ``cp_packing.attention.dispatch.select_backend`` (and ``ring_dtype_refusal`` for the ring) on a small probe
    shard of every layout, so the launcher keeps no second copy of what each backend supports. A UsageError (with
    the backend's own reason) when it runs none: a kernel not available here, ring-flash-attn not installed,
    Ulysses with a CP size that does not divide the heads, ..."""
    from cp_packing.attention.dispatch import select_backend
    from cp_packing.attention.ring import ring_dtype_refusal
    from cp_packing.sharding import shard_packed_seq_params

    H, H_kv, D = heads
    params = packed_seq_params_from_doc_ids(torch.ones(1, 2 * cp, dtype=torch.int64))  # valid for every layout
    q = torch.zeros(2, H, D, device=device, dtype=dtype)  # [T_local, H, D]
    ok, reasons = [], []
    for layout in LAYOUTS:
        sharded = shard_packed_seq_params(params, cp_size=cp, cp_rank=0, layout=layout)
        try:
            chosen, _ = select_backend(q, sharded, backend=backend, kernel=kernel, num_kv_heads=H_kv)
        except (ValueError, ImportError, NotImplementedError) as exc:
            reasons.append(str(exc))
            continue
        refusal = ring_dtype_refusal(layout, dtype) if chosen == "ring_flash_attn" and backend != "auto" else None
        if refusal is None:
            ok.append(layout)
        else:
            reasons.append(refusal)
    if not ok:
        raise UsageError(f"--attn-backend {backend} --kernel {kernel} cannot run here ({device.type}, "
                         f"{str(dtype).removeprefix('torch.')}, cp={cp}): {reasons[0]}")
    return tuple(ok)


def finish(setup: Setup, device: torch.device) -> argparse.Namespace:
    """The device-dependent checks, on every rank before the first step: dtype, kernel, backend and layout."""
    from cp_packing.attention.kernels import available_kernels

    args = copy.copy(setup.args)
    args.cp = setup.world if args.cp is None else args.cp
    if args.dtype is None:
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        args.dtype = "bfloat16" if bf16 else "float32"
    if args.kernel != "auto" and args.kernel not in available_kernels(device):
        raise UsageError(f"--kernel {args.kernel} is not available on {device.type} here (available: "
                         f"{', '.join(available_kernels(device))}); pick one of them or --kernel auto")
    args.layouts = backend_layouts(args.attn_backend, args.kernel, args.cp, device, DTYPES[args.dtype],
                                   heads_of(setup.config))
    if args.layout != "auto" and args.layout not in args.layouts:
        raise UsageError(f"--attn-backend {args.attn_backend} has no kernel for --layout {args.layout} here; use "
                         f"{', '.join(args.layouts)} or auto")
    return args


# ---------------------------------------------------------------------------------------------------- data


def synthetic_batch(args, step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """The ``[B, S]`` batch of one DP replica at one step: ``{"doc_ids", "input_ids", "labels"}`` (labels shifted
    on the global stream). Every document is an arithmetic progression of token ids (mod V) with its own start and
    stride."""
    seed = args.seed * 1_000_003 + step * 1009 + dp_rank
    B, S, V = args.batch, args.seq_len, args.vocab
    doc = synthetic_doc_ids("lognormal", B, S, seed=seed, median=args.mean_doc_len, sigma=args.doc_len_sigma,
                            pad=0.1)
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
    return {"doc_ids": doc, "input_ids": ids, "labels": next_token_labels(ids, doc)}


def batch_stream(args, data, dp_size: int) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Steps of ``dp_size`` replica batches: packed ``--data`` documents (epoch after epoch, each packed with its
    own seed), or synthetic batches. Every rank computes the same stream."""
    if data is None:
        step = 0
        while True:
            yield [synthetic_batch(args, step, r) for r in range(dp_size)]
            step += 1
    from cp_packing.packing import pack_documents

    epoch = 0
    while True:
        empty = True
        for step in pack_documents(data.documents, seq_len=args.seq_len, rows=args.batch, dp_size=dp_size,
                                   seed=args.seed + epoch, drop_last=True):  # every step [batch, seq_len]
            empty = False
            yield step
        if empty:
            return
        epoch += 1


def lay_out(batch: dict, args, cp: int) -> tuple[dict[str, torch.Tensor], str]:
    """``(batch, layout)``: the layout this batch is sharded with (``--layout``, or ``auto`` among the backend's
    layouts: the library's per-batch ``auto`` when the backend runs them all, else the one of lowest busiest-rank
    cost), and the batch padded to multiples of ``2*cp`` per document for zigzag (pad tokens: label -100). Adds
    ``"real"``: False on padding and pad tokens."""
    layout = args.layout
    if layout == "auto" and set(args.layouts) != set(LAYOUTS):
        costs = {}
        for name in args.layouts:
            try:
                costs[name] = layout_cost(batch["doc_ids"], cp_size=cp, layout=name,
                                          window=getattr(args, "windows", None)).busiest_cost
            except ValueError:  # contiguous / balanced on a batch not divisible by cp
                pass
        layout = min(costs, key=costs.__getitem__)
    doc = batch["doc_ids"].to(torch.int64)
    out = {"doc_ids": doc, "input_ids": batch["input_ids"], "labels": batch["labels"], "real": doc != 0}
    if layout == "zigzag":
        from cp_packing.padding import pad_segments

        padded = pad_segments(doc, multiple=2 * cp, tensors={"input_ids": out["input_ids"], "labels": out["labels"]})
        out = {"doc_ids": padded.doc_ids, "input_ids": padded.tensors["input_ids"],
               "labels": padded.tensors["labels"], "real": ~padded.is_pad & (padded.doc_ids != 0)}
    return out, layout


# ---------------------------------------------------------------------------------------------------- model


def build_model(args, attn: str, dtype: torch.dtype = torch.float32, config: Any = None):
    """The model of ``--model`` with attention ``attn``: a preset from ``config`` (default: ``preset_config(args)``),
    the same random init on every rank (``--seed``), or the local directory's weights (never downloaded)."""
    from transformers import AutoModelForCausalLM

    if args.model in PRESETS:
        config = preset_config(args) if config is None else copy.deepcopy(config)  # never share a config object
        torch.manual_seed(args.seed)  # the same weights on every rank
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(dtype)
    return AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn, local_files_only=True,
                                                dtype=dtype)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # an FSDP2 DTensor gathered


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([_full(p.grad).reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
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
        dev = next(ref_model.parameters()).device
        logits = ref_model(input_ids=batch["input_ids"].to(dev), position_ids=pos.to(dev), attention_mask=mask.to(dev),
                           use_cache=False).logits
        ce = F.cross_entropy(logits.float().reshape(B * S, -1), batch["labels"].to(dev).reshape(-1),
                             ignore_index=-100, reduction="sum")
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
    mesh: object | None = None  # the ("dp", "cp") DeviceMesh (built for FSDP2 and for dp > 1)


def make_groups(world: int, cp: int, device: torch.device, need_mesh: bool) -> Groups:
    if cp == world and not need_mesh:
        return Groups(dist.group.WORLD, None, cp, dist.get_rank(), 1, 0)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    dp_group = mesh["dp"].get_group() if world // cp > 1 else None
    return Groups(mesh["cp"].get_group(), dp_group, cp, mesh.get_local_rank("cp"), world // cp,
                  mesh.get_local_rank("dp"), mesh)


def shard_with_fsdp2(model, mesh) -> None:
    """FSDP2 (``fully_shard``) over the flattened ``("dp", "cp")`` mesh: every decoder layer, then the model, each
    unit SUMming gradients (the CP-exact loss is a share of the global mean: averaging would divide by dp*cp; see
    docs/integration.md and tests/test_fsdp2.py)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    flat = mesh["dp", "cp"]._flatten("dp_cp")  # CP ranks hold the same parameters: shard over dp*cp
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UsageError(f"--fsdp shards model.model.layers, which {type(model).__name__} does not have")
    for layer in layers:
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)


class SigtermStop:
    """SIGTERM sets a flag (the handler does nothing else); the training loop agrees on it over the world after each
    step, so every rank stops after the same step, saves and exits."""

    def __init__(self):
        self.requested = False
        self.previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA max allocated on a GPU, else the largest resident set size so far."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def save_model(model, setup: Setup, fsdp: bool, rank: int) -> None:
    """``save_pretrained`` (and the tokenizer) to ``--output-dir`` on rank 0; under FSDP2 every rank first joins
    the gathering of the full state dict (to rank 0's CPU)."""
    state_dict = None
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        out = setup.args.output_dir
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out, state_dict=state_dict)
        if setup.tokenizer is not None:
            setup.tokenizer.save_pretrained(out)
        print(f"saved the model{' and tokenizer' if setup.tokenizer is not None else ''} to {out}", flush=True)
    dist.barrier()


def _describe(setup: Setup, groups: Groups, model, args, device) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    data = "synthetic documents"
    if setup.data is not None:
        data = (f"{args.data} ({len(setup.data.documents):,} documents, {setup.data.tokens:,} tokens from "
                f"'{setup.data.column}'" + (f", {setup.data.skipped} empty rows skipped" if setup.data.skipped else "")
                + ")")
    return (f"cp-packing train: world={setup.world} dp={groups.dp_size} cp={groups.cp_size} layout={args.layout} "
            f"({'/'.join(args.layouts)} for attention backend {args.attn_backend}) device={device} "
            f"backend={dist.get_backend()} dtype={args.dtype} fsdp={'on' if args.fsdp else 'off'} "
            f"model={args.model} ({n_params / 1e6:.2f}M params) batch={args.batch}x{args.seq_len} data={data}")


def train(setup: Setup, args, rank: int, device: torch.device) -> int:
    stop = SigtermStop()  # first: a SIGTERM while the model loads stops the run after its first step
    try:
        return _train(setup, args, rank, device, stop)
    finally:
        stop.restore()


class Parity:
    """``--check-parity``: a non-CP copy of the model (HF sdpa, block-diagonal mask) trained on the union of the DP
    replicas' batches for the first steps; each step compares the loss and every gradient before either optimizer
    steps (the model's gradients must already be reduced)."""

    def __init__(self, model, args, steps: int):
        self.steps = steps
        self.ref_model = copy.deepcopy(model)  # before any FSDP sharding
        self.ref_model.set_attn_implementation("sdpa")
        self.ref_opt = torch.optim.AdamW(self.ref_model.parameters(), lr=args.lr, weight_decay=0.01)
        self.dtype_name = args.dtype
        self.loss_tol, self.grad_tol = PARITY_TOL[DTYPES[args.dtype]]
        self.worst_loss, self.worst_grad, self.first_failure = 0.0, 0.0, None

    def check(self, step: int, loss: float, model, batches: list[dict], is_main: bool) -> None:
        self.ref_opt.zero_grad(set_to_none=True)
        ref_t = reference_loss(self.ref_model, batches)
        ref_t.backward()
        ref = float(ref_t.detach())
        d_loss = abs(loss - ref)
        g_cp, g_ref = _flat_grads(model).float(), _flat_grads(self.ref_model).float()
        d_grad = float((g_cp - g_ref).abs().max())
        scale = float(g_ref.abs().max())
        ok = d_loss <= self.loss_tol * max(1.0, abs(ref)) and d_grad <= self.grad_tol * scale + 1e-7
        self.worst_loss = max(self.worst_loss, d_loss)
        self.worst_grad = max(self.worst_grad, d_grad / max(scale, 1e-30))
        if not ok and self.first_failure is None:
            self.first_failure = step
        if is_main:
            print(f"parity step {step + 1}: loss cp={loss:.6f} ref={ref:.6f} |diff|={d_loss:.2e}; grads "
                  f"max|diff|={d_grad:.2e} (max|grad|={scale:.2e}) {'ok' if ok else 'MISMATCH'}", flush=True)
        self.ref_opt.step()

    def verdict(self, cp: int, is_main: bool) -> int:
        """Print the summary on rank 0; the exit status (0 PASS, 1 FAIL)."""
        if is_main:
            print(f"parity ({self.steps} steps, cp={cp} vs cp=1, {self.dtype_name}): max |loss diff| = "
                  f"{self.worst_loss:.3e} (tol {self.loss_tol:g} x max(1, |loss|)), max grad diff / max|grad| = "
                  f"{self.worst_grad:.3e} (tol {self.grad_tol:g}): {'PASS' if self.first_failure is None else 'FAIL'}",
                  flush=True)
        return 0 if self.first_failure is None else 1


def progress_line(step: int, args, loss: float, dt: float, laid: list, cp: int, peak: float, dp_rank: int) -> str:
    """One plain progress line (see docs/launcher.md): imbalance = busiest / mean causal cost over the CP ranks of
    the layout each replica used (``cp_packing.cost.layout_cost``), the worst replica; tok/s counts real tokens."""
    costs = [layout_cost(b["doc_ids"], cp_size=cp, layout=name, window=getattr(args, "windows", None))
             for b, name in laid]
    imbalance = max(c.imbalance for c in costs)
    real = sum(int(b["real"].sum()) for b, _ in laid)
    return (f"step {step + 1:>4}/{args.steps}  loss {loss:.4f}  time {dt * 1e3:,.0f} ms  tok/s {real / dt:,.0f}  "
            f"imbalance {imbalance:.3f}  peak mem {peak / 2**20:,.0f} MiB  layout {costs[dp_rank].layout}")


def _cp_step(model, opt, batch: dict, layout: str, args, groups: Groups, device: torch.device) -> float:
    """Ship this replica's batch to its CP ranks, forward and backward with CP attention, reduce the gradients
    (SUM over CP and DP; FSDP2 does it in backward); returns the global loss. The optimizer does not step here."""
    payload = None
    if args.local_data or groups.cp_rank == 0:
        payload = {k: v.to(device) for k, v in batch.items() if k != "real"}
    local, sharded = distribute_batch(payload, None, group=groups.cp, src=None if args.local_data else 0,
                                      layout=layout, window=getattr(args, "windows", None))
    inputs = cp_model_inputs(local, sharded, group=groups.cp, backend=args.attn_backend, kernel=args.kernel)
    logits = model(**inputs).logits[0]  # [T_local, V]
    share = packed_cross_entropy(logits, local["labels"][0], group=groups.cp, dp_group=groups.dp)
    opt.zero_grad(set_to_none=True)
    share.backward()
    if not args.fsdp and not args.inject_fault:  # (the fault: a trainer that forgets the CP gradient reduction)
        _all_reduce_grads(model, [groups.cp, groups.dp])  # the loss contract: SUM over CP (and DP)
    return float(reduce_loss_for_logging(share, group=groups.cp, dp_group=groups.dp))


def _train(setup: Setup, args, rank: int, device: torch.device, stop: SigtermStop) -> int:
    groups = make_groups(setup.world, args.cp, device, need_mesh=args.fsdp)
    cp, is_main = groups.cp_size, rank == 0
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # plain lines only: HF's loading / saving bars are tqdm
    model = build_model(args, register_cp_attention(), DTYPES[args.dtype], setup.config).to(device).train()
    args.windows = model_windows(model.config)  # sliding layers: plan and report the windowed cost
    parity = Parity(model, args, min(args.parity_steps, args.steps)) if args.check_parity else None
    if args.fsdp:
        shard_with_fsdp2(model, groups.mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if is_main:
        print(_describe(setup, groups, model, args, device), flush=True)
    log_every = args.log_every or max(1, args.steps // 20)
    stream = batch_stream(args, setup.data, groups.dp_size)
    history, stopped_at = [], None
    for step in range(args.steps):
        laid = [lay_out(b, args, cp) for b in next(stream)]  # every DP replica's batch, on every rank
        sync(device)
        t0 = time.perf_counter()
        loss = _cp_step(model, opt, *laid[groups.dp_rank], args, groups, device)
        parity_time = 0.0
        if parity is not None and step < parity.steps:  # before either optimizer steps
            tp = time.perf_counter()
            parity.check(step, loss, model, [b for b, _ in laid], is_main)
            parity_time = time.perf_counter() - tp
        opt.step()
        sync(device)
        dt = time.perf_counter() - t0 - parity_time
        # one small all-reduce (MAX) over the world: peak memory, and whether any rank got SIGTERM
        flags = torch.tensor([float(peak_memory_bytes(device)), float(stop.requested)], dtype=torch.float64,
                             device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        history.append(loss)
        if is_main and ((step + 1) % log_every == 0 or step == 0 or step + 1 == args.steps or flags[1] > 0):
            print(progress_line(step, args, loss, dt, laid, cp, float(flags[0]), groups.dp_rank), flush=True)
        if flags[1] > 0:
            stopped_at = step + 1
            break

    if is_main:
        print(f"done: {len(history)} steps, loss {history[0]:.4f} -> {history[-1]:.4f}", flush=True)
        if stopped_at is not None:
            print(f"SIGTERM: stopped after step {stopped_at} of {args.steps}", flush=True)
    if args.output_dir is not None:
        save_model(model, setup, args.fsdp, rank)
    if stopped_at is not None:
        return EXIT_SIGTERM
    return parity.verdict(cp, is_main) if parity is not None else 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------- entry


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m cp_packing train`` (no abbreviations: a prefix never silently means another
    option, and none is also one of torchrun's)."""
    from cp_packing.attention.dispatch import BACKENDS
    from cp_packing.attention.kernels import KERNELS

    pos, nonneg = _at_least(1), _at_least(0)
    p = argparse.ArgumentParser(prog="python -m cp_packing train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="llama", help=f"a preset ({', '.join(PRESETS)}: tiny, random init) or a local HF "
                   "model directory (config + weights [+ tokenizer]); default llama")
    g.add_argument("--data", default=None, help="a local .jsonl or .parquet file with a 'text' column (needs the "
                   "model directory's tokenizer) or 'input_ids' (+ optional 'labels'); default: synthetic documents")
    g.add_argument("--output-dir", default=None, help="save the trained model (and tokenizer) here with "
                   "save_pretrained, at the end and on SIGTERM; default: not saved")
    for name, help_ in (("hidden", "hidden size"), ("layers", "decoder layers"), ("heads", "query heads"),
                        ("kv-heads", "key/value heads"), ("vocab", "vocabulary size")):
        g.add_argument(f"--{name}", type=pos, default=None,
                       help=f"preset only: {help_} (default {PRESET_SIZES[name.replace('-', '_')]})")
    g.add_argument("--mean-doc-len", type=_positive_float, default=None,
                   help="synthetic data: median document length of the lognormal (default seq-len / 8)")
    g.add_argument("--doc-len-sigma", type=float, default=1.0, help="synthetic data: lognormal sigma (default 1)")
    g = p.add_argument_group("parallelism and attention")
    g.add_argument("--nproc", type=pos, default=None,
                   help="without torchrun: fork this many CPU ranks in a gloo group (default 2)")
    g.add_argument("--cp", type=pos, default=None, help="CP group size (default: the world size; else DP x CP)")
    g.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 over the DP x CP ranks")
    g.add_argument("--layout", choices=LAYOUT_CHOICES, default="auto", help="token placement over the CP ranks "
                   "(default auto: per batch, the cheapest among the layouts --attn-backend runs)")
    g.add_argument("--attn-backend", choices=tuple(b for b in BACKENDS if b != "hybrid"), default="auto",
                   help="CP attention backend (default auto, see docs/attention.md)")
    g.add_argument("--kernel", default="auto", choices=("auto", *KERNELS),
                   help="varlen attention kernel (default auto: the best one available)")
    g.add_argument("--local-data", action="store_true",
                   help="every CP rank shards the batch itself (default: CP rank 0 scatters it)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=pos, default=20, help="optimizer steps (default 20)")
    g.add_argument("--seq-len", type=pos, default=256, help="tokens per row (default 256)")
    g.add_argument("--batch", type=pos, default=2, help="rows per DP replica per step (default 2)")
    g.add_argument("--lr", type=_positive_float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    g.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default bfloat16 on CUDA where supported, else float32")
    g.add_argument("--seed", type=nonneg, default=0, help="model init (presets), data order, synthetic data")
    g.add_argument("--log-every", type=pos, default=None, help="print a step line every N steps (default steps/20)")
    g.add_argument("--check-parity", action="store_true", help="compare the first steps with a non-CP model")
    g.add_argument("--parity-steps", type=pos, default=2, help="steps --check-parity compares (default 2)")
    g.add_argument("--dry-run", action="store_true",
                   help="check every option, the model and the data against the world, then exit 0 (or 2)")
    p.add_argument("--inject-fault", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the options that need neither files nor the world (exit 2 with one line otherwise)."""
    p = rank0_parser(build_parser())
    args = p.parse_args(argv)
    if args.mean_doc_len is None:
        args.mean_doc_len = max(1.0, args.seq_len / 8)
    if args.doc_len_sigma < 0:
        p.error(f"--doc-len-sigma must be >= 0, got {args.doc_len_sigma}")
    return args


def _run(setup: Setup, rank: int, world: int) -> int:
    device = rank_device()
    try:
        args = finish(setup, device)
    except UsageError as e:  # the same on every rank: one line, exit 2
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        return train(setup, args, rank, device)
    except UsageError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception:  # noqa: BLE001 - any other error (a library ValueError too): on the rank that raised it, exit 1
        print(f"error on rank {rank} of {world}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1


def world_size(args) -> int:
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else (args.nproc or 2)


def main(argv=None) -> int:
    """``python -m cp_packing train``: returns the exit status (0 ok, 1 error or parity FAIL, 2 usage error, 143
    stopped by SIGTERM after saving)."""
    args = parse_args(argv)
    try:
        setup = prepare(args, world_size(args))
        if args.dry_run:
            import torch.cuda

            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if (
                under_torchrun() and torch.cuda.is_available()) else torch.device("cpu")
            finish(setup, device)
    except UsageError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.dry_run:
        if os.environ.get("RANK", "0") == "0":
            print("dry run: every option checked, nothing trained", flush=True)
        return 0
    return launch(functools.partial(_run, setup), args.nproc)


if __name__ == "__main__":
    sys.exit(main())
