"""agree(): one exchange per call; every rank raises the same error, no rank is left waiting in a collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_packing.agreement import AgreementError, agree, digest
from cp_packing.testing import run_distributed

pytestmark = pytest.mark.distributed


def _catch(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return (type(exc).__name__, str(exc))


def test_digest_sees_order_dtype_and_small_changes():
    a = torch.tensor([[1, 1, 2], [3, 3, 3]])
    assert digest(a) == digest(a.clone())
    assert digest(a) != digest(a.flip(0))  # the same rows in another order
    assert digest(a) != digest(a.to(torch.int32))
    b = a.clone().reshape(-1)
    b[0] += 1; b[1] -= 2; b[2] += 1  # a linear checksum would not see a +1/-2/+1 change
    assert digest(a) != digest(b.reshape(2, 3))
    assert digest(a) != digest(a.reshape(3, 2))


def test_no_group_raises_the_local_error_as_is():
    with pytest.raises(TypeError, match="boom"):
        agree(None, "call", {}, error=TypeError("boom"))
    assert agree(None, "call", {"x": 1})[0].fields == {"x": 1}


def _scenarios(rank, world):
    g = dist.group.WORLD
    out = {}
    out["same"] = _catch(lambda: len(agree(g, "f", {"layout": "zigzag", "n": 3})))
    out["field"] = _catch(lambda: agree(g, "f", {"layout": "zigzag" if rank else "balanced", "n": 3}))
    out["call"] = _catch(lambda: agree(g, "attention" if rank == 1 else "loss", {"n": 3}))
    # a different call AND different fields AND another payload size: still pairs up, still one clear error
    out["mixed"] = _catch(lambda: agree(g, "loss", {"a": 1}, payload=list(range(1000)))
                          if rank == 0 else agree(g, "distribute_batch", {"b": 2, "c": 3}))
    out["error"] = _catch(lambda: agree(g, "f", {"n": 3}, error=TypeError("bad q") if rank == 1 else None))
    out["after"] = _catch(lambda: len(agree(g, "f", {"n": 4})))  # the group still works after every failure
    return out


def test_every_rank_raises_the_same_error():
    results = run_distributed(_scenarios, 3, timeout=120)
    for key in ("field", "call", "mixed", "error"):
        kinds = {r[key][0] for r in results}
        assert len(kinds) == 1, (key, results)
    assert all(r["same"] == ("ok", 3) and r["after"] == ("ok", 3) for r in results)
    assert results[0]["field"][0] == "AgreementError" and "disagree on layout" in results[0]["field"][1]
    assert "rank 0: 'balanced'" in results[2]["field"][1] and "ranks 1, 2: 'zigzag'" in results[2]["field"][1]
    assert results[1]["call"][0] == "AgreementError" and "rank 1 in attention" in results[1]["call"][1]
    assert "different calls" in results[0]["mixed"][1]
    assert results[0]["error"] == results[2]["error"] and results[0]["error"][0] == "TypeError"
    assert "bad q" in results[0]["error"][1] and "rank 1" in results[0]["error"][1]
    assert issubclass(AgreementError, ValueError)


def test_bench_agreement_quick_counts_three_exchanges_per_step():
    """The per-step cost benchmark runs, and a training step makes exactly three agreements (distribute, attention
    once for all layers, loss): the script exits non-zero otherwise."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "bench_agreement.py"), "--quick"],
                       capture_output=True, text=True, timeout=600, cwd=repo,
                       env={**os.environ, "PYTHONPATH": repo})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "counts ok: every step made 3 agreements" in r.stdout, r.stdout
