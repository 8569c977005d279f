"""The docs stay true: the API reference and the layout pictures are regenerated from the code, the README's example
runs and prints what it claims, and every relative link in README.md and docs/ points at a file that exists."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_api_reference_is_current():
    proc = _run("scripts/gen_api_docs.py", "--check")
    assert proc.returncode == 0, proc.stderr


def test_layout_pictures_are_current():
    proc = _run("scripts/draw_layouts.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() in open(os.path.join(ROOT, "docs", "layouts.md")).read(), (
        "docs/layouts.md is stale: run python scripts/draw_layouts.py --write"
    )


def test_readme_seed_example_runs_and_its_comments_hold():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    assert "packed_seq_params_from_doc_ids" in block
    namespace: dict = {}
    exec(block, namespace)  # noqa: S102 - our own README
    params = namespace["params"]
    assert params.cu_seqlens.tolist() == [0, 2, 5, 6] and params.max_seqlen == 3
    kwargs = namespace["to_flash_attention_kwargs"](params)
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 3


@pytest.mark.parametrize("path", ["README.md"] + [f"docs/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                                  if f.endswith(".md")])
def test_relative_links_resolve(path):
    text = open(os.path.join(ROOT, path)).read()
    base = os.path.dirname(os.path.join(ROOT, path))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        assert os.path.exists(os.path.join(base, target)), f"{path} links to missing {target}"


def _readme_hf_example(rank: int, world: int) -> dict:
    """Run the README's HuggingFace block as written on a real CP group, and the same model without CP."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig

    import cp_packing
    from cp_packing.hf import cp_model_inputs

    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.findall(r"```python\n(.*?)```", readme, re.S)[1]
    assert "distribute_batch" in block and "cp_model_inputs" in block
    torch.manual_seed(0)
    doc_ids = torch.tensor([[1] * 10 + [2] * 14 + [0] * 8, [1] * 20 + [2] * 12])  # documents cross shard edges
    namespace = {
        "config": LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0),
        "doc_ids": doc_ids,
        "input_ids": torch.randint(0, 64, doc_ids.shape),
        "cp_group": dist.group.WORLD,
    }
    torch.manual_seed(1)
    exec(block, namespace)  # noqa: S102 - our own README
    model, loss = namespace["model"], namespace["loss"]
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)  # the README's "then all-reduce (SUM) the gradients over the CP group"
    cp_loss = float(cp_packing.reduce_loss_for_logging(loss, group=dist.group.WORLD))

    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    params = cp_packing.packed_seq_params_from_doc_ids(doc_ids)
    labels = cp_packing.next_token_labels(namespace["input_ids"], doc_ids).reshape(-1)
    ref_logits = ref(**cp_model_inputs(namespace["input_ids"], params)).logits[0]
    ref_loss = cp_packing.packed_cross_entropy(ref_logits, labels)
    ref_loss.backward()
    grad_diff = max(float((g - p.grad).abs().max()) for g, p in zip(grads, ref.parameters()))
    return {"cp_loss": cp_loss, "ref_loss": float(ref_loss), "grad_diff": grad_diff}


@pytest.mark.distributed
def test_readme_hf_example_runs_on_a_cp_group_and_matches_no_cp():
    from cp_packing.testing import run_distributed

    for result in run_distributed(_readme_hf_example, 2):
        assert abs(result["cp_loss"] - result["ref_loss"]) < 1e-5, result
        assert result["grad_diff"] < 1e-5, result


@pytest.mark.parametrize("module", ["cp_packing.packed_seq", "cp_packing.sharding", "cp_packing.adapters",
                                    "cp_packing.agreement", "cp_packing.groups", "cp_packing._checks",
                                    "cp_packing.attention.dispatch", "cp_packing.attention.ulysses",
                                    "cp_packing.loader",
                                    "cp_packing.attention.hybrid", "cp_packing.layouts.work",
                                    "cp_packing.attention.ops", "cp_packing.report", "cp_packing.packing",
                                    "cp_packing.trainer"])
def test_docstring_examples_run(module):
    """The ``>>>`` examples in the public docstrings are what the code does."""
    import doctest
    import importlib

    mod = importlib.import_module(module)
    result = doctest.testmod(mod, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0, result


# ------------------------------------------------------------------------------------------------ docs/data.md


def _data_md_blocks() -> tuple[list[str], str]:
    """docs/data.md's python blocks: the in-process ones, in order, and the torchrun script."""
    blocks = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "docs", "data.md")).read(), re.S)
    scripts = [b for b in blocks if "init_device_mesh" in b]
    assert len(scripts) == 1 and len(blocks) >= 8
    return [b for b in blocks if b is not scripts[0]], scripts[0]


def test_data_md_examples_run():
    """Every format example and the single-process loader examples of docs/data.md, as written, in one namespace
    (their asserts are the claims)."""
    namespace: dict = {}
    for block in _data_md_blocks()[0]:
        exec(block, namespace)  # noqa: S102 - our own docs


def _data_md_script(rank: int, world: int) -> dict:
    import multiprocessing

    from cp_packing.agreement import digest

    # run_ranks forks daemonic ranks, which may not start the script's DataLoader workers (torchrun's may)
    multiprocessing.current_process().daemon = False
    namespace: dict = {"__name__": "train_cp"}
    exec(_data_md_blocks()[1], namespace)  # noqa: S102 - our own docs
    return {"losses": namespace["losses"], "weights": digest(*namespace["model"].parameters())}


@pytest.mark.distributed
def test_data_md_torchrun_script_trains():
    """The torchrun script of docs/data.md on 2 gloo ranks (DP 1 x CP 2): two epochs of steps, the same logged loss
    and the same weights on every rank."""
    from cp_packing.testing import run_distributed

    results = run_distributed(_data_md_script, 2)
    losses = results[0]["losses"]
    assert len(losses) >= 4 and all(math.isfinite(x) for x in losses)
    assert all(r["losses"] == losses and r["weights"] == results[0]["weights"] for r in results)
