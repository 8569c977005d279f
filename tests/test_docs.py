"""The docs stay true: the API reference, the module table and the layout pictures are regenerated from the code; every
python block of README.md and docs/ compiles, uses only names it defines, imports or documents as placeholders, and
runs where it is complete; the layering is one-way; every ``>>>`` example of cp_packing runs; every relative link in
README.md and docs/ points at a file that exists."""

from __future__ import annotations

import ast
import functools
import math
import os
import re
import subprocess
import sys
import types

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


# ------------------------------------------------------------------------------------- the snippets of the docs
#
# Every ```python block of README.md and docs/*.md compiles, every name it uses is defined in it, imported by it, a
# builtin or one of PLACEHOLDERS, and every attribute chain on an imported module resolves after the imports the
# block shows (cp_packing.adapters after a plain `import cp_packing` does not: nothing imports it). Blocks with no
# placeholder run, except NOT_RUN. Blocks that cannot be checked (shell, signatures, pseudo-code) are not marked
# python. On the pages of SESSIONS the blocks run in order in one namespace (the page says so): a block may use what
# an earlier block of the page defined.

PLACEHOLDERS = {
    # the objects of the reader's own training script
    "model": "an HF causal LM (or any torch module)", "config": "an HF model config", "optimizer": "its optimizer",
    "loader": "an iterable of batches", "dataset": "a tokenized dataset, one document per row",
    "tokenizer": "its tokenizer", "features": "a list of tokenized examples (an HF collator's input)",
    "batch": "a dict of [B, S, ...] tensors with 'doc_ids'", "doc_ids": "a [B, S] doc map",
    "input_ids": "[B, S] token ids", "labels": "[B, S] shifted labels", "logits": "[T_local, V] logits",
    "q": "[T_local, H, D] queries", "k": "[T_local, H_kv, D] keys", "v": "[T_local, H_kv, D] values",
    "H": "query heads", "H_kv": "key/value heads", "D": "head dim",
    "params": "the batch's PackedSeqParams", "sharded": "this rank's ShardedPackedSeqParams",
    # where the script runs
    "cp_group": "the CP ProcessGroup", "mesh": "a ('dp', 'cp') DeviceMesh", "cp": "the CP size",
    "cp_size": "the CP size", "cp_rank": "this rank in the CP group", "rank": "this rank in the CP group",
    "dp_size": "the DP size", "dp_rank": "this replica", "epoch": "the epoch", "i": "a layer index",
}

SESSIONS = ("docs/data.md", "docs/formats.md")

NOT_RUN = {  # (page, a line of the block): why the suite does not exec it (the static checks still run)
    ("docs/data.md", "# train_cp.py"): "a torchrun script: test_data_md_torchrun_script_trains runs it on 2 ranks",
    ("docs/integration.md", "fully_shard(model, mesh=dp_cp_mesh)"): "a torchrun script (tests/test_fsdp2.py tests "
                                                                     "its recipe)",
    ("docs/integration.md", "rfa = import_ring_flash_attn()"): "needs a process group of 2 ranks and ring-flash-attn",
    ("docs/trainer.md", "# train.py: torchrun"): "a torchrun script of 4 ranks",
}

KNOWN_BROKEN: dict = {}  # (page, a line of the block): why it fails today; an expected failure until fixed

OPTIONAL_PACKAGES = ("transformer_engine",)  # imported by a block, not installed here: their attributes go unchecked
DOC_PAGES = ["README.md"] + [f"docs/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]


@functools.lru_cache(maxsize=1)
def _module_table():
    """scripts/gen_module_table.py as a module (the import graph, parsed from the code)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_module_table", os.path.join(ROOT, "scripts",
                                                                                   "gen_module_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(page: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every ```python block of ``page``."""
    text = open(os.path.join(ROOT, page)).read()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S)]


def _listed(table: dict, page: str, code: str):
    return next((why for (where, line), why in table.items() if where == page and line in code), None)


class _Names(ast.NodeVisitor):
    """What a block defines and uses: names, and the attribute chains rooted at a name."""

    def __init__(self) -> None:
        self.defined: set[str] = set()
        self.used: list[tuple[str, int]] = []
        self.chains: list[tuple[list[str], int]] = []
        self.imports: list[tuple[str, str | None, str]] = []  # (module, name or None, bound as)

    def visit_Name(self, node: ast.Name) -> None:
        (self.used.append((node.id, node.lineno)) if isinstance(node.ctx, ast.Load) else self.defined.add(node.id))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if isinstance(value, ast.Name) and isinstance(node.ctx, ast.Load):
            self.chains.append(([value.id, *chain], node.lineno))
        self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> None:
        self.defined.add(node.arg)

    def _define(self, node) -> None:
        self.defined.add(node.name)
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _define

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.defined.add(node.name)
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            bound = a.asname or a.name.split(".")[0]
            self.defined.add(bound)
            self.imports.append((a.name, None, bound))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            self.defined.add(a.asname or a.name)
            self.imports.append((node.module, a.name, a.asname or a.name))


def _bindings(imports: list[tuple[str, str | None, str]]) -> tuple[dict[str, str], list[str], list[str]]:
    """``(name -> module it is bound to, the cp_packing modules imported, errors)``, importing what the block does."""
    import importlib

    bound, roots, errors = {}, [], []
    for module, name, alias in imports:
        if module.split(".")[0] in OPTIONAL_PACKAGES:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            errors.append(f"import {module}: {exc}")
            continue
        if module.split(".")[0] == "cp_packing":
            roots.append(module)
        if name is None:
            bound[alias] = module if alias != module.split(".")[0] else module.split(".")[0]
            continue
        try:
            importlib.import_module(f"{module}.{name}")
            bound[alias] = f"{module}.{name}"
            if module.split(".")[0] == "cp_packing":
                roots.append(f"{module}.{name}")
        except ImportError:
            if not hasattr(sys.modules[module], name):
                errors.append(f"from {module} import {name}: {module} has no {name!r}")
    return bound, roots, errors


def _resolve(chain: list[str], module: str, loaded: frozenset[str]) -> str | None:
    """Why ``chain`` (rooted at a name bound to ``module``) does not resolve after the block's imports, or None."""
    import importlib

    obj = importlib.import_module(module)
    for i, attr in enumerate(chain[1:], 1):
        name = getattr(obj, "__name__", None) if isinstance(obj, types.ModuleType) else None
        if name and name.split(".")[0] == "cp_packing" and f"{name}.{attr}" in _module_table().modules() \
                and f"{name}.{attr}" not in loaded:
            return (f"{'.'.join(chain[:i + 1])}: the block's imports do not import {name}.{attr} (an AttributeError "
                    f"in a fresh interpreter); import it explicitly, e.g. from {name}.{attr} import ...")
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            return f"{'.'.join(chain[:i + 1])}: {'.'.join(chain[:i])} has no attribute {attr!r}"
    return None


def _static_problems(code: str, where: str, known: set[str], known_modules: dict[str, str]) -> list[str]:
    """Everything wrong with one block (compiled, names, attribute chains); ``known``: names an earlier block of a
    session defined. Adds this block's definitions to ``known`` and ``known_modules``."""
    import builtins

    compile(code, where, "exec")
    names = _Names()
    names.visit(ast.parse(code))
    problems = []
    defined = names.defined | known | set(dir(builtins)) | set(PLACEHOLDERS)
    problems += [f"line {line}: {name!r} is not defined, imported or a placeholder (tests/test_docs.py: "
                 "PLACEHOLDERS)" for name, line in names.used if name not in defined]
    bound, roots, errors = _bindings(names.imports)
    problems += errors
    known_modules.update(bound)
    gen = _module_table()
    loaded = frozenset().union(*[gen.loaded_by(m) for m in roots + [m for m in known_modules.values()
                                                                      if m.split(".")[0] == "cp_packing"]])
    for chain, line in names.chains:
        module = known_modules.get(chain[0])
        if module is not None and chain[0] not in names.defined - set(bound):
            why = _resolve(chain, module, loaded)
            if why:
                problems.append(f"line {line}: {why}")
    known |= names.defined
    return problems


def _all_blocks() -> list:
    out = []
    for page in DOC_PAGES:
        for line, code in _blocks(page):
            why = _listed(KNOWN_BROKEN, page, code)
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            out.append(pytest.param(page, line, id=f"{page}:{line}", marks=marks))
    return out


@pytest.mark.parametrize("page,line", _all_blocks())
def test_snippet_names_resolve(page, line):
    """The block compiles; its names are defined, imported, builtins or placeholders; chains on modules resolve."""
    known: set[str] = set()
    known_modules: dict[str, str] = {}
    for at, code in _blocks(page):
        if at > line:
            break
        if page in SESSIONS or at == line:
            problems = _static_problems(code, f"{page}:{at}", known, known_modules)
        if at == line:
            assert not problems, f"{page}:{line}:\n" + "\n".join(problems)


def _uses_placeholders(code: str, known: set[str]) -> bool:
    names = _Names()
    names.visit(ast.parse(code))
    used = {n for n, _ in names.used} - names.defined - known
    return bool(used & set(PLACEHOLDERS))


def _complete_blocks(page: str) -> list[tuple[int, str]]:
    """The blocks of ``page`` the suite runs: no placeholder (after the earlier blocks of a session), not listed."""
    out, known = [], set()
    for line, code in _blocks(page):
        if page not in SESSIONS:
            known = set()
        if not (_listed(NOT_RUN, page, code) or _listed(KNOWN_BROKEN, page, code) or _uses_placeholders(code, known)):
            out.append((line, code))
            names = _Names()
            names.visit(ast.parse(code))
            known |= names.defined
    return out


@pytest.mark.parametrize("page", [page for page in DOC_PAGES if _complete_blocks(page)])
def test_complete_snippets_run(page, monkeypatch):
    """Every block without a placeholder runs as written (in order, in one namespace on a SESSIONS page)."""
    from cp_packing import formats

    monkeypatch.setattr(formats, "_zero_based_warned", False)  # formats.md shows the warning once per process
    namespace: dict = {}
    for line, code in _complete_blocks(page):
        if page not in SESSIONS:
            namespace = {}
        exec(compile(code, f"{page}:{line}", "exec"), namespace)  # noqa: S102 - our own docs


def test_placeholders_are_documented():
    """docs/index.md ("Code in these docs") names every placeholder a snippet may use."""
    text = open(os.path.join(ROOT, "docs", "index.md")).read()
    section = text[text.index("## Code in these docs"):]
    section = section[:section.index("\n## ", 1)]
    assert set(re.findall(r"`(\w+)`", section)) >= set(PLACEHOLDERS)


def test_the_snippet_check_catches_what_the_issue_reported():
    """A name used after an import that does not bind it, a submodule the import does not load, an undefined name."""
    def problems(code):
        return _static_problems(code, "<test>", set(), {})

    assert any("cp_packing.adapters" in p for p in problems("import cp_packing\ncp_packing.adapters.zigzag_kwargs"))
    assert any("transformer_engine_kwargs" in p for p in problems("import cp_packing\n"
                                                                  "cp_packing.transformer_engine_kwargs(x)"))
    assert any("'shard_packed_seq_params' is not defined" in p for p in problems("shard_packed_seq_params(params)"))
    assert problems("from cp_packing.adapters import ring_flash_attn_kwargs\nring_flash_attn_kwargs(sharded)") == []
    assert problems("import cp_packing.hf\ncp_packing.hf.cp_model_inputs\ncp_packing.attention.prepare_attention") \
        == []


def test_not_run_and_known_broken_entries_match_a_block():
    """Every NOT_RUN / KNOWN_BROKEN entry names a block that exists (a renamed block must not hide)."""
    for table in (NOT_RUN, KNOWN_BROKEN):
        for page, line in table:
            assert any(line in code for _, code in _blocks(page)), f"{page}: no python block has {line!r}"


# ------------------------------------------------------------------------------- docs/index.md: the module table

# Imports that go UP the layers of scripts/gen_module_table.py (LAYERS) today, each reported to the lead: the test
# fails on any other (a new upward import), and on one of these once it is gone (remove the entry then).
KNOWN_UPWARD: dict = {  # (module, imported module) -> why, for an upward import accepted on purpose
    ("cp_packing.groups", "cp_packing.gradients"): "CPMesh.sum_gradients delegates to cp_packing.sum_gradients (inside "
                                                   "the method: the mesh type stays at the bottom)",
}


def test_module_table_is_current():
    proc = _run("scripts/gen_module_table.py", "--check")
    assert proc.returncode == 0, proc.stderr


def test_layering_is_one_way():
    """No import cycle at module level, and no import goes up the layers of docs/index.md's table (module level or
    inside functions) except the known ones."""
    gen = _module_table()
    assert gen.cycles() == [], f"import cycles at module level: {gen.cycles()}"
    up = {(m, t): kind for kind in ("module", "function") for m, t in gen.upward(kind)}
    new = [f"{m} imports {t} ({kind} level): layer {gen.layer_of(gen.unit_of(m))} -> layer "
           f"{gen.layer_of(gen.unit_of(t))}" for (m, t), kind in up.items() if (m, t) not in KNOWN_UPWARD]
    assert not new, "imports that go up the layers (scripts/gen_module_table.py LAYERS):\n" + "\n".join(new)
    gone = [pair for pair in KNOWN_UPWARD if pair not in up]
    assert not gone, f"no longer upward, remove from KNOWN_UPWARD: {gone}"


def test_static_import_closure_is_what_python_loads():
    """The snippet checks' model of what ``import cp_packing`` loads (module-level imports, parsed) is what a fresh
    interpreter loads."""
    gen = _module_table()
    code = "import sys, cp_packing; print(sorted(m for m in sys.modules if m.split('.')[0] == 'cp_packing'))"
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert ast.literal_eval(proc.stdout.strip()) == sorted(gen.loaded_by("cp_packing"))


def _readme_hf_example(rank: int, world: int) -> dict:
    """Run the README's HuggingFace block as written on a real CP group, and the same model without CP."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import cp_packing
    from cp_packing.hf import cp_model_inputs

    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.findall(r"```python\n(.*?)```", readme, re.S)[1]
    assert "distribute_batch" in block and "sum_gradients(model, cp_group)" in block and "optimizer.step()" in block
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
    grads = [p.grad.clone() for p in model.parameters()]  # summed over the group by the block's sum_gradients
    cp_loss = float(cp_packing.reduce_loss_for_logging(loss, group=dist.group.WORLD))

    ref = copy.deepcopy(model)  # the block's initial weights (same seed), without its optimizer step
    torch.manual_seed(1)
    ref.load_state_dict(AutoModelForCausalLM.from_config(namespace["config"]).state_dict())
    assert not any(torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters()))  # the step ran
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


# ------------------------------------------------------------------------------------------------ doctests

# Modules that import an optional dependency at module level: their doctests run where it is installed.
OPTIONAL_AT_IMPORT = {"cp_packing.trainer": "transformers"}


def _package_modules() -> list[str]:
    import pkgutil

    import cp_packing

    return ["cp_packing"] + sorted(m.name for m in pkgutil.walk_packages(cp_packing.__path__, "cp_packing."))


def test_optional_imports_at_module_level_are_the_listed_ones():
    """The skip list of the doctests is exact: the modules whose module level imports an optional dependency."""
    gen = _module_table()
    optional = {"transformers", "trl", "datasets", "flash_attn", "ring_flash_attn", "transformer_engine",
                "matplotlib", "pyarrow", "accelerate"}
    found = {}
    for module, path in gen.modules().items():
        tree = ast.parse(open(path).read())
        stack = [tree]
        while stack:
            node = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else \
                    [child.module or ""] if isinstance(child, ast.ImportFrom) else []
                for name in names:
                    if name.split(".")[0] in optional:
                        found[module] = name.split(".")[0]
                stack.append(child)
    assert found == OPTIONAL_AT_IMPORT


@pytest.mark.parametrize("module", _package_modules())
def test_docstring_examples_run(module):
    """The ``>>>`` examples of every module of cp_packing are what the code does."""
    import doctest
    import importlib

    if module in OPTIONAL_AT_IMPORT:
        pytest.importorskip(OPTIONAL_AT_IMPORT[module])
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, result


# ------------------------------------------------------------------------------------------------ docs/data.md


def _data_md_blocks() -> tuple[list[str], str]:
    """docs/data.md's python blocks: the in-process ones, in order (test_complete_snippets_run runs them), and the
    torchrun script."""
    blocks = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "docs", "data.md")).read(), re.S)
    scripts = [b for b in blocks if "init_device_mesh" in b]
    assert len(scripts) == 1 and len(blocks) >= 8
    return [b for b in blocks if b is not scripts[0]], scripts[0]


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


def test_the_capabilities_table_in_the_docs_is_generated_from_the_code():
    """docs/attention.md shows cp_packing.capabilities' table as the code has it (the one table select_backend, the
    refusals and the verifier read)."""
    from cp_packing.capabilities import markdown_table

    text = open(os.path.join(ROOT, "docs", "attention.md")).read()
    begin, end = "<!-- capabilities:begin (generated from cp_packing.capabilities.markdown_table()) -->\n", \
        "\n<!-- capabilities:end -->"
    assert begin in text and end in text
    assert text.split(begin)[1].split(end)[0] == markdown_table(), "regenerate the table in docs/attention.md"
