"""groups: the shard-vs-group check shared by attention and the loss (no process group needed)."""

from __future__ import annotations

import pytest

from cp_packing.groups import backend_for_device, check_shard_in_group


def test_shard_in_group_names_the_mismatch_and_the_fix():
    check_shard_in_group(4, 2, 4, 2)  # the right shard: no error
    with pytest.raises(ValueError, match=r"sharded.cp_size=2 but the CP group has 4 ranks; .* cp_size=4"):
        check_shard_in_group(2, 0, 4, 0)
    with pytest.raises(ValueError, match=r"sharded.cp_rank=0 but this process is rank 1 of the CP group; .*mesh\['cp'\]"):
        check_shard_in_group(2, 0, 2, 1)  # the DP x CP mesh mistake: every rank sharded as rank 0
    with pytest.raises(ValueError, match="the given group has 3 ranks"):
        check_shard_in_group(2, 0, 3, 0, which="the given group")


def test_backend_for_device_reads_per_device_configs():
    assert backend_for_device("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for_device("cuda:nccl", "cpu") == ""


def test_cp_mesh_from_ints_checks_and_pickles_without_groups():
    import pickle

    import pytest

    from cp_packing.groups import CPMesh

    mesh = CPMesh.from_ints(dp_rank=1, dp_size=2, cp_rank=1, cp_size=4)
    assert (mesh.global_rank, mesh.world_size) == (5, 8)
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    with pytest.raises(ValueError, match="cp_rank must be <= 3"):
        CPMesh.from_ints(cp_rank=4, cp_size=4)
    with pytest.raises(TypeError, match="dp_size must be an int"):
        CPMesh.from_ints(dp_size="2")
    assert CPMesh.from_world(1) == CPMesh.from_ints()  # no torch.distributed: the one-process mesh
    with pytest.raises(ValueError, match="needs a process group"):
        CPMesh.from_world(2)
