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


def test_bench_agreement_quick_counts_two_exchanges_per_step():
    """The per-step cost benchmark runs, and a training step makes exactly two agreements (distribute, attention
    once for all layers; the loss on the prepared step is local math): the script exits non-zero otherwise."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "bench_agreement.py"), "--quick"],
                       capture_output=True, text=True, timeout=600, cwd=repo,
                       env={**os.environ, "PYTHONPATH": repo})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "counts ok: every step made 2 agreements" in r.stdout, r.stdout


def _crossed_groups(rank, world):
    """dp 2 x cp 2: rank 0 passes the world as its CP group, the others their CP group."""
    import time

    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = cp_groups[rank // 2]
    t0 = time.monotonic()
    result = _catch(lambda: agree(dist.group.WORLD if rank == 0 else mine, "attention", {"n": 1}))
    return result, time.monotonic() - t0


def test_ranks_that_pass_different_groups_both_raise_within_seconds():
    from cp_packing.agreement import agreement_timeout

    results = run_distributed(_crossed_groups, 4, timeout=120)
    (r0, s0), (r1, s1), (r2, _), (r3, _) = results
    assert r0[0] == r1[0] == "AgreementError", results
    assert "passed different groups" in r0[1] and "global ranks [0, 1]" in r0[1], r0
    assert "global ranks [0, 1, 2, 3]" in r1[1], r1
    assert max(s0, s1) < agreement_timeout() / 4  # found while waiting, not at the timeout
    assert r2[0] == r3[0] == "ok", results  # the other CP group is not involved


def _one_rank_absent(rank, world):
    import time

    from cp_packing.agreement import set_agreement_timeout

    set_agreement_timeout(3.0)
    if rank == 1:
        time.sleep(5.0)  # busy elsewhere: never reaches the agreement within the bound
        return ("absent", 0.0)
    t0 = time.monotonic()
    return _catch(lambda: agree(dist.group.WORLD, "packed_cross_entropy", {})), time.monotonic() - t0


def test_a_peer_that_never_arrives_is_a_bounded_wait_naming_it():
    results = run_distributed(_one_rank_absent, 3, timeout=120)
    for rank in (0, 2):
        (kind, message), seconds = results[rank]
        assert kind == "AgreementTimeout", results[rank]
        assert "rank 1 of the CP group" in message and "packed_cross_entropy" in message and "3 s" in message
        assert 2.5 < seconds < 20


def _fail_together_classes(rank, world):
    from cp_packing.agreement import fail_together

    out = {}
    for name, exc in (("runtime", RuntimeError("kernel said no")), ("key", KeyError("k")), ("index", IndexError(3))):
        def block():
            with fail_together("f", (dist.group.WORLD, "CP group")) as agreement:
                agreement.fields["n"] = 1
                if rank == 1:
                    raise exc
        out[name] = _catch(block)
    out["after"] = _catch(lambda: len(agree(dist.group.WORLD, "g", {})))
    return out


def test_fail_together_raises_every_exception_class_on_every_rank():
    results = run_distributed(_fail_together_classes, 2, timeout=120)
    assert results[0] == results[1], results
    assert results[0]["runtime"][0] == "RuntimeError" and "kernel said no" in results[0]["runtime"][1]
    assert results[0]["key"][0] == "KeyError" and results[0]["index"][0] == "IndexError"
    assert results[0]["after"] == ("ok", 2)


def test_the_timeout_is_configurable_and_checked(monkeypatch):
    from cp_packing.agreement import DEFAULT_TIMEOUT, TIMEOUT_ENV, agreement_timeout, set_agreement_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert agreement_timeout() == DEFAULT_TIMEOUT == 120.0
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert agreement_timeout() == 7.5
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="CP_PACKING_TIMEOUT='soon'"):
        agreement_timeout()
    set_agreement_timeout(2)
    try:
        assert agreement_timeout() == 2.0
        with pytest.raises(ValueError, match="got 0"):
            set_agreement_timeout(0)
    finally:
        set_agreement_timeout(None)
