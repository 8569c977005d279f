"""The checks of ``python -m cp_packing train`` before any rank trains (``cp_packing.tools.train``): the options
against each other and the world, the model (preset or local directory, its weights opened), the data, the output
directory (written to), a checkpoint to resume; then, on every rank, the device-dependent ones (kernel, backend,
layouts). Every failure is a ``UsageError``: one line on rank 0, exit 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from cp_packing.layouts import LAYOUTS
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.testing import under_torchrun
from cp_packing.tools.checkpoint import checkpoint_dirs, find_checkpoint, read_state
from cp_packing.tools.data import batch_stream, eval_batches

__all__ = ["DTYPES", "PRESETS", "PRESET_SIZES", "RESUME_KEYS", "Setup", "UsageError", "backend_layouts", "finish",
           "heads_of", "model_dir_config", "prepare", "preset_config", "resume_facts"]

PRESETS = ("llama", "qwen3")
PRESET_SIZES = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 256}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Options a resumed run must share with the run that wrote the checkpoint (the data position, the per-rank RNG
#: files and the model's shape depend on them); anything else (--steps, --lr, --layout, --fsdp ...) may change.
RESUME_KEYS = ("model", "hidden", "layers", "heads", "kv_heads", "vocab", "world", "cp", "batch", "seq_len",
               "grad_accum", "seed", "data", "mean_doc_len", "doc_len_sigma")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


class UsageError(Exception):
    """Options that do not fit the model, the data or the world: exit 2, one line on rank 0, before the first step.
    Every rank finds it alike (the same options, files and world). Not a ValueError, so a library ValueError during
    training is never mistaken for one."""


@dataclass
class Setup:
    """What every rank starts from, checked before any rank trains: the options, the world size, the model config
    (preset, model directory or checkpoint), its tokenizer (or None), the documents of ``--data`` and
    ``--eval-data`` (or None) and the checkpoint to resume (or None)."""

    args: argparse.Namespace
    world: int
    config: Any
    tokenizer: Any = None
    data: Any = None  # cp_packing.tools.data.Documents
    eval_data: Any = None
    resume: str | None = None  # a complete checkpoint directory


def preset_config(args) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=max(4096, 2 * args.seq_len), attention_dropout=0.0, tie_word_embeddings=False)
    if args.model == "llama":
        return LlamaConfig(**common)
    return Qwen3Config(head_dim=args.hidden // args.heads, **common)


def _check_weight_files(path: str, option: str) -> None:
    """Open every weight file of a model directory (safetensors headers and sizes; torch zip archives, memory-mapped,
    no tensor read): a truncated or corrupt file is a UsageError here, not a crash after the ranks started."""
    names = sorted(f for f in os.listdir(path) if f.endswith(WEIGHT_SUFFIXES))
    if not names:
        raise UsageError(f"{option} {path!r} has a config.json but no weights (*.safetensors / pytorch_model*.bin)")
    for name in names:
        file = os.path.join(path, name)
        try:
            if name.endswith(".index.json"):
                with open(file, encoding="utf-8") as f:
                    shards = set(json.load(f)["weight_map"].values())
                missing = sorted(s for s in shards if not os.path.isfile(os.path.join(path, s)))
                if missing:
                    raise ValueError(f"it names {missing[0]!r}, which is not there")
            elif name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(file, "pt") as f:
                    for key in f.keys():
                        f.get_slice(key)
            else:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - safetensors, zip, pickle and json each raise their own type
            raise UsageError(f"{option} {path!r}: the weights file {name} does not load ({type(exc).__name__}: "
                             f"{exc}); write the model again with save_pretrained") from None


def model_dir_config(path: str, option: str = "--model") -> tuple[Any, Any]:
    """``(config, tokenizer or None)`` of a local HF model directory, its weight files opened; a UsageError when it
    is not one."""
    from transformers import AutoConfig, AutoTokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{option} {path!r} is not a HF model directory (no config.json); give a directory written "
                         f"by save_pretrained, or a preset: {', '.join(PRESETS)}")
    _check_weight_files(path, option)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, OSError, KeyError, ... on a bad config
        raise UsageError(f"{option} {path!r}: its config.json does not load ({type(exc).__name__}: {exc})") from None
    from cp_packing.model_features import check_cp_supported

    try:  # a family CP cannot run (Falcon: attention inside the model, not through AttentionInterface) is one line
        check_cp_supported(config)
    except ValueError as exc:
        raise UsageError(f"{option} {path!r}: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer files (OSError/ValueError/TypeError by version): token ids only
        tokenizer = None
    return config, tokenizer


def prepare(args, world: int) -> Setup:
    """Every check that needs no process group: sizes against the world, the training options, the model, the
    tokenizer, the data (read and tokenized here), the output directory, the checkpoint to resume. Raises
    UsageError."""
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
    _check_training_options(args)
    config, tokenizer = _model_config(args)
    data = _documents(args, args.data, "--data", config, tokenizer, world // cp) if args.data is not None else None
    eval_data = None
    if args.eval_data is not None:
        eval_data = _documents(args, args.eval_data, "--eval-data", config, tokenizer, world // cp)
    resume = None
    if args.resume is not None:
        resume = _resume_checkpoint(args, world, cp)
        config = model_dir_config(resume, "--resume")[0]  # the trained weights' own config
    if args.output_dir is not None:
        _check_output_dir(args.output_dir, resuming=resume is not None)
    return Setup(args=args, world=world, config=config, tokenizer=tokenizer, data=data, eval_data=eval_data,
                 resume=resume)


def _check_training_options(args) -> None:
    """The training options against each other (sizes and ranges are the parser's)."""
    if args.warmup_steps and args.lr_scheduler == "constant":
        raise UsageError(f"--lr-scheduler constant ignores --warmup-steps {args.warmup_steps}; use "
                         "--lr-scheduler constant_with_warmup (or linear, cosine, ...)")
    if args.check_parity and args.resume is not None:
        raise UsageError("--check-parity trains a reference model from the first step; it cannot start from "
                         "--resume: drop one of them")
    if args.eval_data is not None and not args.eval_every:
        args.eval_every = args.steps  # evaluate once, after the last step


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


def _documents(args, path: str, option: str, config, tokenizer, dp_size: int):
    """The documents of ``--data`` / ``--eval-data`` (``cp_packing.tools.data``), checked to fill one step."""
    from cp_packing.tools.data import load_documents

    try:
        data = load_documents(path, tokenizer=tokenizer, vocab_size=config.vocab_size)
    except ValueError as exc:
        raise UsageError(str(exc).replace("--data", option, 1)) from None
    try:
        first = next(iter(batch_stream(args, data, dp_size)), None) if option == "--data" else \
            next(iter(eval_batches(args, data, dp_size)), None)
    except (ValueError, TypeError) as exc:  # the packer's own checks
        raise UsageError(f"{option} {path!r}: {exc}") from None
    if first is None:
        raise UsageError(f"{option} {path!r} ({len(data.documents)} documents, {data.tokens:,} tokens) does not "
                         f"fill one step of {dp_size} DP replica(s) x --batch {args.batch} rows x --seq-len "
                         f"{args.seq_len}; lower --batch or --seq-len, or give more data")
    return data


def _check_output_dir(path: str, *, resuming: bool) -> None:
    """``--output-dir`` is written to now (created if missing, a file created and removed in it), so a path under a
    regular file, in /proc or on a read-only mount fails here and not at the first save; and it holds no checkpoint
    of another run unless this one resumes (a new run would delete it at its first save)."""
    out = os.path.abspath(path)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--output-dir {path!r} is a file; give a directory")
    probe = os.path.join(out, f".cp-packing-write-test-{os.getpid()}")
    try:
        os.makedirs(out, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as f:
            f.write("cp-packing checks that it can write here\n")
        os.remove(probe)
    except OSError as exc:
        raise UsageError(f"--output-dir {path!r} is not writable ({exc.strerror or type(exc).__name__}: "
                         f"{exc.filename or out}); give a directory you can write to") from None
    found = checkpoint_dirs(out)
    if found and not resuming:
        raise UsageError(f"--output-dir {path!r} holds {os.path.basename(found[-1][1])} of an earlier run, which "
                         f"this run would delete; continue it with --resume {path}, or give another --output-dir")


def _resume_checkpoint(args, world: int, cp: int) -> str:
    """The checkpoint ``--resume`` names, checked against this run (``RESUME_KEYS``, ``--steps``); its directory
    becomes the default ``--output-dir``."""
    path = args.resume
    if not os.path.isdir(path):
        raise UsageError(f"--resume {path!r} is not a directory; give a checkpoint (OUT/checkpoint-<step>) or the "
                         "--output-dir that holds them")
    checkpoint = find_checkpoint(path)
    if checkpoint is None:
        raise UsageError(f"--resume {path!r} holds no complete checkpoint (a checkpoint-<step> directory with "
                         "trainer_state.json; a .partial one was cut short and is not resumable)")
    try:
        state = read_state(checkpoint)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--resume {checkpoint!r}: its trainer_state.json does not load ({exc})") from None
    now = resume_facts(args, world, cp)
    differ = [k for k in RESUME_KEYS if state.get(k) != now[k]]
    if differ:
        was = ", ".join(f"{k}={state.get(k)!r} (now {now[k]!r})" for k in differ)
        raise UsageError(f"--resume {checkpoint!r} was written by a run with {was}; resume with the options of that "
                         "run (and the same world size), or start a new one")
    if state["step"] >= args.steps:
        raise UsageError(f"--resume {checkpoint!r} is at step {state['step']}, not before --steps {args.steps}; "
                         "raise --steps to train further")
    if args.output_dir is None:
        args.output_dir = os.path.dirname(os.path.abspath(checkpoint))
    return checkpoint


def resume_facts(args, world: int, cp: int) -> dict[str, Any]:
    """The ``RESUME_KEYS`` of this run (paths made absolute), as a checkpoint records them."""
    facts = {k: getattr(args, k, None) for k in RESUME_KEYS}
    for k in ("model", "data"):
        if facts[k] is not None and (k == "data" or facts[k] not in PRESETS):
            facts[k] = os.path.abspath(facts[k])
    return {**facts, "world": world, "cp": cp}


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
        except (ValueError, TypeError, ImportError, NotImplementedError) as exc:  # TypeError: the ring's dtypes
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
