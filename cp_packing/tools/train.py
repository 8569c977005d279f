"""Train a causal LM with context parallelism: a preset tiny model on synthetic documents, or YOUR local HF model
directory on YOUR local jsonl / parquet data, checkpointed (resumable) and saved with ``save_pretrained``.

    torchrun --nproc-per-node 2 -m cp_packing train                   # CP over every rank (NCCL on GPUs, else gloo)
    torchrun --nproc-per-node 4 -m cp_packing train --cp 2            # DP x CP = 2 x 2, DeviceMesh ("dp", "cp")
    python -m cp_packing train --nproc 2 --steps 5 --check-parity     # no torchrun: forks a gloo group on CPU
    torchrun --nproc-per-node 2 -m cp_packing train --model ./my-model --data ./train.jsonl --seq-len 1024 \\
        --steps 100 --lr-scheduler cosine --warmup-steps 10 --max-grad-norm 1 --grad-accum 4 \\
        --eval-data ./val.jsonl --eval-every 20 --save-every 50 --output-dir ./trained
    ... --resume ./trained                                            # continue from its last checkpoint

Model (``--model``): a preset (``llama`` / ``qwen3``: tiny random-init, sized by --hidden/--layers/--heads/--kv-heads/
--vocab) or a local HF model directory (config + weights, and a tokenizer for text data; never downloaded). Data
(``--data``): a local ``.jsonl`` or ``.parquet`` file with a ``text`` column (tokenized with the model directory's
tokenizer) or ``input_ids`` (optional ``labels``), see ``cp_packing.tools.data``; packed into ``--batch`` rows of
``--seq-len`` tokens per DP replica and micro-batch. Without ``--data``: synthetic lognormal-length documents whose
tokens are arithmetic progressions (something to learn).

Each micro-batch, CP rank 0 of every DP replica ships each CP rank its tokens (``cp_packing.distribute_batch``);
labels are shifted on the global stream; ``--layout auto`` picks per batch among the layouts ``--attn-backend`` runs.
The loss of a micro-batch is ``cp_packing.packed_linear_cross_entropy`` on the decoder's hidden states and the output
projection, which never builds the ``[T_local, V]`` logits (``--no-chunked-loss``, or a model it cannot run:
``cp_packing.packed_cross_entropy`` on the logits), with ``num_items_in_batch`` = the valid labels of all
``--grad-accum`` micro-batches of all replicas (``cp_packing.count_valid_labels``); gradients are SUMmed over CP
and DP (``--fsdp``: FSDP2 over the DP x CP mesh with SUM reduction), clipped by their global norm
(``--max-grad-norm``), and AdamW steps on a ``transformers.get_scheduler`` schedule (``--lr-scheduler``,
``--warmup-steps``). ``--eval-every K``: a CP evaluation (no grad) on ``--eval-data`` or a synthetic eval set.

Checkpoints (``--output-dir OUT``): ``OUT/checkpoint-<step>`` every ``--save-every`` steps, on SIGTERM and at the end
(with ``--save-every``), written atomically (model, optimizer, scheduler, step, per-rank RNG, data position; the
previous one is deleted only once the new one is complete); ``--resume OUT`` continues bit for bit. The final model
goes to ``OUT`` (``save_pretrained``). SIGTERM (a preemption): every rank finishes its step, a checkpoint is written
and the run exits 143; a rank whose launcher died stops the same way.

Exit status: 0 ok, 1 an error (its traceback from the rank that raised it) or ``--check-parity`` FAIL, 2 a usage
error (one line on rank 0, before the first step), 3 stopped by SIGTERM with no checkpoint written (before the first
step, or without --output-dir), 143 stopped by SIGTERM after writing a checkpoint. See docs/launcher.md.
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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_packing._checks import IGNORE_INDEX
from cp_packing.cost import layout_cost
from cp_packing.distributed import distribute_batch
from cp_packing.gradients import sum_gradients
from cp_packing.groups import CPMesh
from cp_packing.hf import cp_model_inputs, model_windows, register_cp_attention
from cp_packing.labels import valid_label_mask
from cp_packing.layouts import LAYOUTS
from cp_packing.loss import count_valid_labels, packed_cross_entropy, reduce_loss_for_logging
from cp_packing.options import AttentionOptions
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.testing import rank_device, under_torchrun
from cp_packing.tools import finite_float, launch, nonnegative_int, positive_int, rank0_parser
from cp_packing.tools.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from cp_packing.tools.data import batch_stream, eval_batches, lay_out, synthetic_batch
from cp_packing.tools.lifecycle import PREEMPTION, watch_parent
from cp_packing.tools.train_setup import (DTYPES, PRESET_SIZES, PRESETS, Setup, UsageError, backend_layouts, finish,
                                          prepare, preset_config, resume_facts)

__all__ = ["EXIT_SIGTERM", "EXIT_STOPPED", "UsageError", "backend_layouts", "build_model", "build_parser",
           "lay_out", "main", "parse_args", "prepare", "reference_loss", "step_num_items", "synthetic_batch"]

LAYOUT_CHOICES = (*LAYOUTS, "auto")
#: ``--lr-scheduler`` names: ``transformers.get_scheduler``'s that need nothing but the warmup and total steps.
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
                 "inverse_sqrt")
# (loss, gradients) parity tolerances, relative to max(1, |loss|) and to the largest reference gradient.
PARITY_TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (3e-2, 2e-1), torch.float16: (1e-2, 1e-1)}
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: stopped by SIGTERM after writing a checkpoint
EXIT_STOPPED = 3  # stopped by SIGTERM, no checkpoint written (before the first step, or no --output-dir)
FAULTS = ("grad-reduction", "kill-mid-save", "sigterm@K")  # --inject-fault (tests): see _fault


# ---------------------------------------------------------------------------------------------------- model


def build_model(args, attn: str, dtype: torch.dtype = torch.float32, config: Any = None, path: str | None = None):
    """The model of ``--model`` with attention ``attn``: the weights of ``path`` (a checkpoint to resume) or of the
    local directory (never downloaded), or a preset from ``config`` (default ``preset_config(args)``), the same
    random init on every rank (``--seed``)."""
    from transformers import AutoModelForCausalLM

    if path is None and args.model in PRESETS:
        config = preset_config(args) if config is None else copy.deepcopy(config)  # never share a config object
        torch.manual_seed(args.seed)  # the same weights on every rank
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(dtype)
    return AutoModelForCausalLM.from_pretrained(path or args.model, attn_implementation=attn, local_files_only=True,
                                                dtype=dtype)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # an FSDP2 DTensor gathered


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([_full(p.grad).reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                      for p in model.parameters()])


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
                             ignore_index=IGNORE_INDEX, reduction="sum")
        total = ce if total is None else total + ce
        count += int(valid_label_mask(batch["labels"]).sum())
    return total / max(count, 1)


def make_optimizer(model, args):
    """``(AdamW, its transformers.get_scheduler schedule)`` of the options (the math of HF's Trainer)."""
    from transformers import get_scheduler

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return opt, get_scheduler(args.lr_scheduler, opt, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.steps)


def _clip(model, max_norm: float | None) -> float | None:
    """Clip the GLOBAL gradient norm (the gradients are already summed over CP and DP, so every rank clips the
    same; FSDP2's sharded gradients are normed over the mesh); returns the norm before clipping."""
    if max_norm is None:
        return None
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(_full(norm))


# ---------------------------------------------------------------------------------------------------- steps


def make_mesh(world: int, cp: int, device: torch.device) -> CPMesh:
    """The ``("dp", "cp")`` mesh of the world (consecutive ranks form a CP group); a one-rank world is its own CP
    group."""
    return CPMesh.from_world(cp, device_type=device.type)


def _cp_group(mesh: CPMesh):
    return mesh.cp_group if mesh.cp_group is not None else dist.group.WORLD


def shard_with_fsdp2(model, mesh: CPMesh, device: torch.device) -> None:
    """FSDP2 (``fully_shard``) over the flattened ``("dp", "cp")`` mesh: every decoder layer, then the model, each
    unit SUMming gradients (the CP-exact loss is a share of the global mean: averaging would divide by dp*cp; see
    docs/integration.md and tests/test_fsdp2.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if mesh.device_mesh is not None:
        flat = mesh.device_mesh["dp", "cp"]._flatten("dp_cp")  # CP ranks hold the same parameters: shard over dp*cp
    else:
        flat = init_device_mesh(device.type, (mesh.world_size,), mesh_dim_names=("dp_cp",))
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


def step_num_items(batches: list[tuple[dict, str]], mesh: CPMesh) -> int:
    """The valid labels of a step's micro-batches ``(replica batch, layout)`` over every replica: the one count
    (``count_valid_labels``) of whole batches, so over DP only (each CP rank holds its replica's whole batches)."""
    return count_valid_labels([b["labels"] for b, _ in batches], dp_group=mesh.dp_group)


def _share(model, batch: dict, layout: str, num_items: int, args, mesh: CPMesh, device: torch.device):
    """Ship one replica batch to its CP ranks and return this rank's loss share over ``num_items`` valid labels."""
    group = _cp_group(mesh)
    payload = None
    if args.local_data or mesh.cp_rank == 0:
        payload = {k: v.to(device) for k, v in batch.items() if k != "real"}
    local, sharded = distribute_batch(payload, None, group=group, src=None if args.local_data else 0,
                                      layout=layout, window=getattr(args, "windows", None))
    inputs = cp_model_inputs(local, sharded, group=group,
                             options=AttentionOptions(backend=args.attn_backend, kernel=args.kernel))
    # local math: the step's count over CP x DP (count_valid_labels, once per optimizer step) divides this rank's sum
    count = {"sharded": inputs["cp_sharded"], "num_items_in_batch": num_items}
    projection = getattr(args, "projection", None)
    if projection is None:  # --no-chunked-loss, or a model the chunked loss cannot run
        logits = model(**inputs).logits[0]  # [T_local, V]
        return packed_cross_entropy(logits, local["labels"][0], **count)
    from cp_packing.trainer import forward_hidden

    _, hidden = forward_hidden(model, projection, inputs)  # [T_local, D]: no logits built
    return projection.loss(hidden, local["labels"][0], **count)


def _cp_step(model, micro: list[tuple[dict, str]], args, mesh: CPMesh, device: torch.device) -> float:
    """One optimizer step's gradients: every micro-batch of this replica forward and backward with CP attention,
    each share over the step's GLOBAL count of valid labels (all micro-batches, all replicas; docs/loss.md), the
    gradients accumulated, then SUMmed over CP and DP (FSDP2 does it in backward). Returns the step's global loss;
    the optimizer does not step here."""
    num_items = step_num_items(micro, mesh)
    loss = 0.0
    for batch, layout in micro:
        share = _share(model, batch, layout, num_items, args, mesh, device)
        share.backward()
        loss += float(reduce_loss_for_logging(share, group=_cp_group(mesh), dp_group=mesh.dp_group))
    if not args.fsdp and args.inject_fault != "grad-reduction":  # (the fault: a trainer that forgets it)
        sum_gradients(model, mesh)  # the loss contract: SUM over CP (and DP)
    return loss


@torch.no_grad()
def evaluate(model, batches: list[tuple[dict, str]], args, mesh: CPMesh, device: torch.device) -> tuple[float, int]:
    """``(loss, valid labels)`` of the evaluation set under CP, without gradients: the token mean over every valid
    label of every eval batch of every replica (what ``reference_loss`` computes on their union in one process)."""
    model.eval()
    try:
        num_items = step_num_items(batches, mesh)
        loss = sum(float(reduce_loss_for_logging(_share(model, b, layout, num_items, args, mesh, device),
                                                 group=_cp_group(mesh), dp_group=mesh.dp_group))
                   for b, layout in batches)
    finally:
        model.train()
    return loss, num_items


class Parity:
    """``--check-parity``: a non-CP copy of the model (HF sdpa, block-diagonal mask) with its own optimizer and
    schedule, trained on the union of every replica's micro-batches for the first steps; each step compares the loss
    and every gradient before either clips or steps (the model's gradients must already be reduced)."""

    def __init__(self, model, args, steps: int):
        self.steps = steps
        self.ref_model = copy.deepcopy(model)  # before any FSDP sharding
        self.ref_model.set_attn_implementation("sdpa")
        self.ref_opt, self.ref_sched = make_optimizer(self.ref_model, args)
        self.max_grad_norm = args.max_grad_norm
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
        _clip(self.ref_model, self.max_grad_norm)
        self.ref_opt.step()
        self.ref_sched.step()

    def verdict(self, cp: int, is_main: bool) -> int:
        """Print the summary on rank 0; the exit status (0 PASS, 1 FAIL)."""
        if is_main:
            print(f"parity ({self.steps} steps, cp={cp} vs cp=1, {self.dtype_name}): max |loss diff| = "
                  f"{self.worst_loss:.3e} (tol {self.loss_tol:g} x max(1, |loss|)), max grad diff / max|grad| = "
                  f"{self.worst_grad:.3e} (tol {self.grad_tol:g}): {'PASS' if self.first_failure is None else 'FAIL'}",
                  flush=True)
        return 0 if self.first_failure is None else 1


def progress_line(step: int, args, loss: float, dt: float, laid: list, cp: int, peak: float, dp_rank: int,
                  lr: float, grad_norm: float | None) -> str:
    """One plain progress line (see docs/launcher.md): imbalance = busiest / mean causal cost over the CP ranks of
    the layout each batch used (``cp_packing.cost.layout_cost``), the worst batch of the step; tok/s counts real
    tokens of every micro-batch of every replica; ``laid`` is ``[micro-batch][replica] -> (batch, layout)``."""
    costs = [[layout_cost(b["doc_ids"], cp_size=cp, layout=name, window=getattr(args, "windows", None))
              for b, name in micro] for micro in laid]
    imbalance = max(c.imbalance for micro in costs for c in micro)
    real = sum(int(b["real"].sum()) for micro in laid for b, _ in micro)
    layouts = "/".join(dict.fromkeys(micro[dp_rank].layout for micro in costs))  # what auto picked
    norm = "" if grad_norm is None else f"  grad norm {grad_norm:.3g}"
    return (f"step {step + 1:>4}/{args.steps}  loss {loss:.4f}  time {dt * 1e3:,.0f} ms  tok/s {real / dt:,.0f}  "
            f"imbalance {imbalance:.3f}  peak mem {peak / 2**20:,.0f} MiB  lr {lr:.3g}{norm}  layout {layouts}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA max allocated on a GPU, else the largest resident set size so far."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _any_rank(flag: bool, device: torch.device, extra: float = 0.0) -> tuple[bool, float]:
    """``(flag on any rank, max of extra)``: one small MAX all-reduce over the world."""
    t = torch.tensor([float(flag), extra], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0] > 0), float(t[1])


# ---------------------------------------------------------------------------------------------------- the run


class Run:
    """One rank's training run: the model, optimizer, schedule, data stream and checkpoints, and the step loop
    (``loop``). Built on every rank (collectives inside)."""

    def __init__(self, setup: Setup, args, rank: int, device: torch.device):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # plain lines only: HF's loading / saving bars are tqdm
        self.setup, self.args, self.rank, self.device = setup, args, rank, device
        self.is_main = rank == 0
        self.mesh = make_mesh(setup.world, args.cp, device)
        self.model = build_model(args, register_cp_attention(), DTYPES[args.dtype], setup.config,
                                 path=setup.resume).to(device).train()
        args.windows = model_windows(self.model.config)  # sliding layers: plan and report the windowed cost
        args.projection = None
        if not args.no_chunked_loss:  # before FSDP2 shards the model (its probe runs a 4-token forward)
            from cp_packing.trainer import output_projection

            args.projection, why = output_projection(self.model)
            if why and self.is_main:
                print(f"the loss uses the full logits: {why}", flush=True)
        self.parity = Parity(self.model, args, min(args.parity_steps, args.steps)) if args.check_parity else None
        if args.fsdp:
            shard_with_fsdp2(self.model, self.mesh, device)
        self.opt, self.sched = make_optimizer(self.model, args)
        self.start, position = 0, 0
        if setup.resume is not None:
            state = load_checkpoint(setup.resume, model=self.model, optimizer=self.opt, scheduler=self.sched)
            self.start, position = state["step"], state["micro_batches"]
        self.stream = batch_stream(args, setup.data, self.mesh.dp_size, start=position)
        self.eval_set = None
        if args.eval_every:
            self.eval_set = [[lay_out(b, args, args.cp) for b in step]
                             for step in eval_batches(args, setup.eval_data, self.mesh.dp_size)]
        self.saves, self.saved_step = 0, None

    def save(self, step: int) -> str:
        """Write ``checkpoint-<step>`` (every rank); the data position is the micro-batches consumed."""
        args = self.args
        state = {**resume_facts(args, self.setup.world, args.cp), "micro_batches": step * args.grad_accum,
                 "steps": args.steps, "lr_scheduler": args.lr_scheduler}
        self.saves += 1
        kill = self.args.inject_fault == "kill-mid-save" and self.saves == 2
        path = save_checkpoint(self.args.output_dir, step, model=self.model, optimizer=self.opt,
                               scheduler=self.sched, tokenizer=self.setup.tokenizer, state=state,
                               before_commit=(lambda: os.kill(os.getpid(), signal.SIGKILL)) if kill else None)
        self.saved_step = step
        if self.is_main:
            print(f"saved checkpoint {path}", flush=True)
        return path

    def step(self, step: int) -> tuple[float, float, list, float | None, float]:
        """One optimizer step: ``(loss, seconds, laid micro-batches, grad norm, lr)``."""
        args = self.args
        laid = [[lay_out(b, args, args.cp) for b in next(self.stream)] for _ in range(args.grad_accum)]
        sync(self.device)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = _cp_step(self.model, [micro[self.mesh.dp_rank] for micro in laid], args, self.mesh, self.device)
        parity_time = 0.0
        if self.parity is not None and step < self.parity.steps:  # before either clips or steps
            tp = time.perf_counter()
            self.parity.check(step, loss, self.model, [b for micro in laid for b, _ in micro], self.is_main)
            parity_time = time.perf_counter() - tp
        grad_norm = _clip(self.model, args.max_grad_norm)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        sync(self.device)
        return loss, time.perf_counter() - t0 - parity_time, laid, grad_norm, lr

    def loop(self) -> tuple[list[float], int | None]:
        """The steps from ``start``: ``(losses, the step SIGTERM stopped after, or None)``."""
        args, history = self.args, []
        log_every = args.log_every or max(1, args.steps // 20)
        for step in range(self.start, args.steps):
            loss, dt, laid, grad_norm, lr = self.step(step)
            _fault(args, step + 1, self.rank)
            stop, peak = _any_rank(PREEMPTION.requested, self.device, float(peak_memory_bytes(self.device)))
            history.append(loss)
            if self.is_main and ((step + 1) % log_every == 0 or step == self.start or step + 1 == args.steps or stop):
                print(progress_line(step, args, loss, dt, laid, args.cp, peak, self.mesh.dp_rank, lr, grad_norm),
                      flush=True)
            if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
                self.eval_line(step)
            if args.output_dir is not None and args.save_every and (
                    (step + 1) % args.save_every == 0 or step + 1 == args.steps):
                self.save(step + 1)
            if stop:
                return history, step + 1
        return history, None

    def eval_line(self, step: int) -> None:
        loss, labels = evaluate(self.model, [micro[self.mesh.dp_rank] for micro in self.eval_set], self.args,
                                self.mesh, self.device)
        if self.is_main:
            print(f"eval after step {step + 1}: loss {loss:.6f} ({len(self.eval_set)} batches x "
                  f"{self.mesh.dp_size} replica(s), {labels:,} labels)", flush=True)


def _fault(args, step: int, rank: int) -> None:
    """``--inject-fault sigterm@K``: after step K (0: before the first), the last rank sends itself SIGTERM (one
    rank preempted: the others learn it in the step's agreement)."""
    fault = args.inject_fault or ""
    if fault.startswith("sigterm@") and int(fault[len("sigterm@"):]) == step and rank == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGTERM)


def save_model(run: Run) -> None:
    """``save_pretrained`` (and the tokenizer) to ``--output-dir`` on rank 0; under FSDP2 every rank first joins
    the gathering of the full state dict (to rank 0's CPU)."""
    state_dict = None
    if run.args.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state_dict = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if run.is_main:
        out, tokenizer = run.args.output_dir, run.setup.tokenizer
        os.makedirs(out, exist_ok=True)
        run.model.save_pretrained(out, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        print(f"saved the model{' and tokenizer' if tokenizer is not None else ''} to {out}", flush=True)
    dist.barrier()


def _describe(run: Run) -> str:
    setup, args, mesh = run.setup, run.args, run.mesh
    n_params = sum(p.numel() for p in run.model.parameters())
    data = "synthetic documents"
    if setup.data is not None:
        data = (f"{args.data} ({len(setup.data.documents):,} documents, {setup.data.tokens:,} tokens from "
                f"'{setup.data.column}'" + (f", {setup.data.skipped} empty rows skipped" if setup.data.skipped else "")
                + ")")
    resumed = f"; resumed from {setup.resume} at step {run.start}" if setup.resume else ""
    return (f"cp-packing train: world={setup.world} dp={mesh.dp_size} cp={mesh.cp_size} layout={args.layout} "
            f"({'/'.join(args.layouts)} for attention backend {args.attn_backend}) device={run.device} "
            f"backend={dist.get_backend()} dtype={args.dtype} fsdp={'on' if args.fsdp else 'off'} "
            f"loss={'chunked' if getattr(args, 'projection', None) is not None else 'logits'} "
            f"model={args.model} ({n_params / 1e6:.2f}M params) batch={args.batch}x{args.seq_len}x{args.grad_accum} "
            f"lr={args.lr:g} ({args.lr_scheduler}, {args.warmup_steps} warmup) data={data}{resumed}")


def train(setup: Setup, args, rank: int, device: torch.device) -> int:
    """One rank's run; returns its exit status."""
    run = Run(setup, args, rank, device)
    if run.is_main:
        print(_describe(run), flush=True)
    _fault(args, run.start, rank)
    if _any_rank(PREEMPTION.requested, device)[0]:  # before the first step: nothing trained, nothing to save
        if run.is_main:
            print("SIGTERM before the first step: nothing trained, no checkpoint written", flush=True)
        return EXIT_STOPPED
    history, stopped_at = run.loop()
    if run.is_main:
        print(f"done: {len(history)} steps, loss {history[0]:.4f} -> {history[-1]:.4f}", flush=True)
    if stopped_at is not None:
        if run.is_main:
            print(f"SIGTERM: stopped after step {stopped_at} of {args.steps}", flush=True)
        if args.output_dir is None:
            return EXIT_STOPPED
        if run.saved_step != stopped_at:
            run.save(stopped_at)
        if run.is_main:
            print(f"resume with --resume {args.output_dir}", flush=True)
        return EXIT_SIGTERM
    if args.output_dir is not None:
        save_model(run)
    return run.parity.verdict(args.cp, run.is_main) if run.parity is not None else 0


# ---------------------------------------------------------------------------------------------------- entry


def _fault_arg(text: str) -> str:
    if text in FAULTS[:2] or (text.startswith("sigterm@") and text[len("sigterm@"):].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"one of {', '.join(FAULTS)}, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m cp_packing train`` (no abbreviations: a prefix never silently means another
    option, and none is also one of torchrun's)."""
    from cp_packing.attention.dispatch import BACKENDS
    from cp_packing.attention.kernels import KERNELS

    pos, nonneg = positive_int, nonnegative_int
    p = argparse.ArgumentParser(prog="python -m cp_packing train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="llama", help=f"a preset ({', '.join(PRESETS)}: tiny, random init) or a local HF "
                   "model directory (config + weights [+ tokenizer]); default llama")
    g.add_argument("--data", default=None, help="a local .jsonl or .parquet file with a 'text' column (needs the "
                   "model directory's tokenizer) or 'input_ids' (+ optional 'labels'); default: synthetic documents")
    g.add_argument("--output-dir", default=None, help="checkpoints (OUT/checkpoint-<step>) and, at the end, the "
                   "trained model (and tokenizer) with save_pretrained; default: nothing saved")
    for name, help_ in (("hidden", "hidden size"), ("layers", "decoder layers"), ("heads", "query heads"),
                        ("kv-heads", "key/value heads"), ("vocab", "vocabulary size")):
        g.add_argument(f"--{name}", type=pos, default=None,
                       help=f"preset only: {help_} (default {PRESET_SIZES[name.replace('-', '_')]})")
    g.add_argument("--mean-doc-len", type=finite_float(0.0, strict=True), default=None,
                   help="synthetic data: median document length of the lognormal (default seq-len / 8)")
    g.add_argument("--doc-len-sigma", type=finite_float(0.0), default=1.0,
                   help="synthetic data: lognormal sigma (default 1)")
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
    g.add_argument("--no-chunked-loss", action="store_true",
                   help="compute the loss on the model's [T_local, V] logits (default: the chunked loss, "
                        "cp_packing.packed_linear_cross_entropy, which never builds them, where the model allows)")
    _training_options(p.add_argument_group("training"), pos, nonneg)
    g = p.add_argument_group("evaluation, checkpoints, signals")
    g.add_argument("--eval-every", type=nonneg, default=0, help="evaluate (CP, no grad) every K steps and after the "
                   "last (default 0: never; --eval-data alone: after the last step)")
    g.add_argument("--eval-data", default=None, help="the evaluation set: a .jsonl / .parquet file like --data "
                   "(default: a synthetic eval stream)")
    g.add_argument("--eval-steps", type=pos, default=2, help="eval micro-batches per replica (default 2)")
    g.add_argument("--save-every", type=nonneg, default=0, help="checkpoint every K steps and after the last "
                   "(default 0: only on SIGTERM)")
    g.add_argument("--resume", default=None, help="continue from a checkpoint: OUT/checkpoint-<step>, or OUT (its "
                   "newest complete one); default --output-dir: that directory")
    g.add_argument("--save-timeout", type=finite_float(0.0, strict=True), default=120.0,
                   help="seconds the ranks get to finish their step and checkpoint after SIGTERM (the --nproc "
                        "parent, and a rank whose launcher died); torchrun: its --shutdown-timeout (default 120)")
    p.add_argument("--inject-fault", type=_fault_arg, default=None, help=argparse.SUPPRESS)
    return p


def _training_options(g, pos, nonneg) -> None:
    g.add_argument("--steps", type=pos, default=20, help="optimizer steps (default 20)")
    g.add_argument("--seq-len", type=pos, default=256, help="tokens per row (default 256)")
    g.add_argument("--batch", type=pos, default=2, help="rows per DP replica per micro-batch (default 2)")
    g.add_argument("--grad-accum", type=pos, default=1,
                   help="micro-batches per optimizer step, gradients accumulated (default 1)")
    g.add_argument("--lr", type=finite_float(0.0, strict=True), default=3e-3, help="AdamW peak learning rate "
                   "(default 3e-3)")
    g.add_argument("--lr-scheduler", choices=LR_SCHEDULERS, default="constant",
                   help="transformers.get_scheduler schedule (default constant)")
    g.add_argument("--warmup-steps", type=nonneg, default=0, help="linear warmup steps of the schedule (default 0)")
    g.add_argument("--weight-decay", type=finite_float(0.0), default=0.01, help="AdamW weight decay (default 0.01)")
    g.add_argument("--max-grad-norm", type=finite_float(0.0, strict=True), default=None,
                   help="clip the global gradient norm to this (default: no clipping)")
    g.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default bfloat16 on CUDA where supported, else float32")
    g.add_argument("--seed", type=nonneg, default=0, help="model init (presets), data order, synthetic data")
    g.add_argument("--log-every", type=pos, default=None, help="print a step line every N steps (default steps/20)")
    g.add_argument("--check-parity", action="store_true", help="compare the first steps with a non-CP model")
    g.add_argument("--parity-steps", type=pos, default=2, help="steps --check-parity compares (default 2)")
    g.add_argument("--dry-run", action="store_true",
                   help="check every option, the model and the data against the world, then exit 0 (or 2)")


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the options that need neither files nor the world (exit 2 with one line otherwise)."""
    p = rank0_parser(build_parser())
    args = p.parse_args(argv)
    if args.mean_doc_len is None:
        args.mean_doc_len = max(1.0, args.seq_len / 8)
    return args


def _run(setup: Setup, rank: int, world: int) -> int:
    if sys.platform != "win32":
        signal.signal(signal.SIGTERM, PREEMPTION.handler)  # first (a forked rank: the flag it inherited stays)
    with watch_parent(setup.args.save_timeout, label=f"rank {rank}"):
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
        except CheckpointError as e:  # a checkpoint fault: one line, the same on every rank
            print(f"error on rank {rank} of {world}: {e}\n", end="", file=sys.stderr, flush=True)  # one write
            return 1
        except Exception:  # noqa: BLE001 - any other error (a library ValueError too): on the rank that raised it
            print(f"error on rank {rank} of {world}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            return 1


def world_size(args) -> int:
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else (args.nproc or 2)


def main(argv=None, *, early_signals: list | None = None) -> int:
    """``python -m cp_packing train``: returns the exit status (0 ok, 1 error or parity FAIL, 2 usage error, 3
    stopped by SIGTERM without a checkpoint, 143 stopped by SIGTERM after writing one). ``early_signals``: SIGTERMs
    an entry point caught while it imported this module (they count as requests to stop)."""
    PREEMPTION.install(early_signals)  # first: a SIGTERM while the data is read is a request to stop, not a kill
    try:
        return _main(argv)
    finally:
        PREEMPTION.restore()


def _main(argv) -> int:
    args = parse_args(argv)
    is_main = os.environ.get("RANK", "0") == "0"
    try:
        setup = prepare(args, world_size(args))
        if args.dry_run:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if (
                under_torchrun() and torch.cuda.is_available()) else torch.device("cpu")
            finish(setup, device)
    except UsageError as e:
        if is_main:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.dry_run:
        if is_main:
            print("dry run: every option checked, nothing trained", flush=True)
        return 0
    if PREEMPTION.requested and not under_torchrun():  # before any rank started
        print("SIGTERM before the first step: nothing trained, no checkpoint written", flush=True)
        return EXIT_STOPPED
    return launch(functools.partial(_run, setup), args.nproc, signal_grace=args.save_timeout)


if __name__ == "__main__":
    sys.exit(main())
