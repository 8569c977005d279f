"""The docs stay true: the API reference and the layout pictures are regenerated from the code, the README's example
runs and prints what it claims, and every relative link in README.md and docs/ points at a file that exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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
