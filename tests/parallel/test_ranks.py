"""Rank layout from torchrun/SLURM environments, backend/device choice, and real spawned gloo groups."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import GlooPools
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from gptpar.config import ParallelConfig
from gptpar.errors import GptparError
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.env import (
    LAUNCHER_MARKER,
    LAUNCHER_PID,
    Layout,
    expand_nodelist,
    free_port,
    is_slurm_step,
    layout_from_env,
    own_job,
    slurm_port,
)
from gptpar.parallel.grid import DP_CP, EXPERT_REPLICAS, composite_groups, coordinates, group_ranks
from gptpar.parallel.process_group import (
    RankInfo,
    choose_backend,
    choose_device,
    destroy_distributed,
    init_distributed,
    nccl_env,
)
from gptpar.parallel.spawn import spawn_local
from gptpar.run.folder import RunFolder


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("a1,b2", ["a1", "b2"]),
    ("gpu[001-003,007]", ["gpu001", "gpu002", "gpu003", "gpu007"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("r[08-11]", ["r08", "r09", "r10", "r11"]),
    ("v[9-10]", ["v9", "v10"]),
    ("n[1-2]-ib[3-4]", ["n1-ib3", "n1-ib4", "n2-ib3", "n2-ib4"]),
    ("c[1,3],gpu[01-02].psc", ["c1", "c3", "gpu01.psc", "gpu02.psc"]),
    ("rack[1-2]n[5]", ["rack1n5", "rack2n5"]),
    ("", []),
])
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[1-3", "gpu1-3]", "gpu[a-c]", "gpu[5-2]"])
def test_expand_nodelist_rejects_malformed(bad: str) -> None:
    with pytest.raises(GptparError, match="node list"):
        expand_nodelist(bad)


def test_slurm_port_is_deterministic_unprivileged_and_distinct_per_job() -> None:
    ports = {slurm_port(job) for job in range(1000, 1100)}
    assert len(ports) == 100
    assert all(20000 <= p < 40000 for p in ports)
    assert slurm_port("123456") == slurm_port(123456) == 20000 + 123456 % 20000
    assert slurm_port("4242_7") == slurm_port("42427")  # array job ids keep their digits


TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h0",
            "MASTER_PORT": "29400", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "98765"}  # in srun


def test_torchrun_env() -> None:
    assert layout_from_env(TORCHRUN) == Layout("torchrun", 5, 8, 1, 4, "h0", 29400)


SRUN = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[012-013]", "SLURM_JOB_ID": "98765",
        "SLURM_STEP_ID": "0"}


def test_slurm_step_env() -> None:
    layout = layout_from_env(SRUN)
    assert layout == Layout("slurm", 6, 8, 2, 4, "gpu012", 20000 + 98765 % 20000)


def test_slurm_explicit_master_wins_and_ntasks_per_node() -> None:
    env = {**SRUN, "MASTER_ADDR": "login1", "MASTER_PORT": "31000", "SLURM_NTASKS_PER_NODE": "2"}
    layout = layout_from_env(env)
    assert (layout.master_addr, layout.master_port, layout.local_world_size) == ("login1", 31000, 2)


def test_slurm_heterogeneous_tasks_per_node() -> None:
    env = {**SRUN, "SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NTASKS": "11", "SLURM_NODEID": "2"}
    assert layout_from_env(env).local_world_size == 3
    with pytest.raises(GptparError, match="SLURM_TASKS_PER_NODE"):
        layout_from_env({**SRUN, "SLURM_TASKS_PER_NODE": "4x2"})


def test_sbatch_script_without_srun_is_not_a_rank() -> None:
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    assert not is_slurm_step(batch)
    assert layout_from_env(batch).launcher == "single"
    one_task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "7"}
    assert layout_from_env(one_task) == Layout("slurm", 0, 1, 0, 1, "n1", 20007)


# What submitit's local executor gives its second task of two (its controller's pid is the job id): no SLURM_*.
SUBMITIT_LOCAL_TASK = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "4321", "SUBMITIT_LOCAL_NTASKS": "2",
                       "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0",
                       "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1"}


def test_submitit_local_executor_env_agrees_with_submitits_own_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = layout_from_env(SUBMITIT_LOCAL_TASK)
    assert layout == Layout("submitit", 1, 2, 1, 2, "127.0.0.1", slurm_port("4321"))
    for key, value in SUBMITIT_LOCAL_TASK.items():
        monkeypatch.setenv(key, value)
    import submitit

    env = submitit.JobEnvironment()  # reads os.environ
    assert (env.global_rank, env.num_tasks, env.local_rank, env.job_id) == (1, 2, 1, "4321")


def test_submitit_on_slurm_reads_srun_and_names_submitit() -> None:
    assert layout_from_env({**SRUN, "SUBMITIT_EXECUTOR": "slurm"}) == Layout(
        "submitit", 6, 8, 2, 4, "gpu012", 20000 + 98765 % 20000)


def test_every_task_of_a_job_is_reached_through_its_launcher_or_its_slurm_job_else_not_at_all() -> None:
    """Who a rank that failed in a collective asks for its peers' dumps (gptpar.launchers.signal_job): never the batch
    shell (no step), nor a torchrun agent inside srun (a SIGQUIT would end it), nor submitit's local controller."""
    local = {"RANK": "1", "WORLD_SIZE": "2", LAUNCHER_MARKER: "local", LAUNCHER_PID: "4242"}
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert [own_job(env) for env in (local, SRUN, {**SRUN, "SUBMITIT_EXECUTOR": "slurm"}, batch, TORCHRUN,
                                       SUBMITIT_LOCAL_TASK, {})] == [
        ("pid", "4242"), ("slurm", "98765"), ("slurm", "98765"), None, None, None, None]


def test_no_launcher_is_single() -> None:
    assert layout_from_env({}) == Layout("single", 0, 1, 0, 1, "127.0.0.1", 29500)


def test_backend_choice() -> None:
    assert choose_backend("auto", 0) == "gloo"
    assert choose_backend("auto", 2) == "nccl"
    assert choose_backend("gloo", 4) == "gloo"
    with pytest.raises(GptparError, match="parallel.backend=nccl"):
        choose_backend("nccl", 0)


def _layout(launcher: str, local_rank: int, local_world: int) -> Layout:
    return Layout(launcher, local_rank, local_world, local_rank, local_world, "h", 1)


def test_device_choice() -> None:
    assert choose_device("gloo", _layout("torchrun", 1, 2), 2) == torch.device("cpu")
    assert choose_device("nccl", _layout("torchrun", 3, 4), 4) == torch.device("cuda:3")
    # SLURM binding one GPU per task: every task sees exactly its own device as cuda:0.
    assert choose_device("nccl", _layout("slurm", 3, 4), 1) == torch.device("cuda:0")
    with pytest.raises(GptparError, match="4 ranks on this node need 4 GPUs but only 2 are visible"):
        choose_device("nccl", _layout("slurm", 3, 4), 2)
    with pytest.raises(GptparError, match="only 1 are visible"):
        choose_device("nccl", _layout("torchrun", 1, 2), 1)


def test_single_process_needs_no_group() -> None:
    info = init_distributed(ParallelConfig(backend="gloo"), env={})
    assert (info.rank, info.world_size, info.launcher, info.device.type) == (0, 1, "single", "cpu")
    assert not dist.is_initialized()


def test_missing_peer_fails_init_within_timeout_naming_rank(tmp_path) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with pytest.raises(GptparError, match=r"rank 0/2: joining the process group .* parallel.timeout_s=1"):
        init_distributed(ParallelConfig(backend="gloo", timeout_s=1), env=env, nccl_trace_prefix=tmp_path / "trace_")
    assert not dist.is_initialized()
    assert not set(nccl_env(tmp_path)) & set(os.environ)  # NCCL's settings stay off gloo's ranks


def test_nccl_ranks_get_torch_s_flight_recorder_dumping_into_the_run_folder_on_a_timeout(tmp_path) -> None:
    """The environment set before init_process_group on NCCL, under torch 2.13's names and the older ones (read in
    torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp, FlightRecorder.hpp); NCCL itself cannot run here."""
    prefix = RunFolder(tmp_path).nccl_trace_prefix
    assert nccl_env(prefix) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/job/nccl_trace_rank_",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{tmp_path}/job/nccl_trace_rank_"}
    assert "TORCH_FR_DUMP_TEMP_FILE" not in nccl_env(None)  # no run folder named before the group: torch's default


def _join_world_of_one() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_a_new_worlds_dtensors_use_its_groups_not_a_left_worlds_of_the_same_name() -> None:
    """DTensor's sharding cache holds the first mesh equal (by ranks) to a later one, and a mesh finds its group by
    name, which a new world reuses: unless leaving the world forgets that cache, a DTensor of the new world's mesh
    came out on the old mesh, whose all-gather ran on another group named as its was (test_tp_torch's CI failure)."""
    whole = torch.arange(6.0).reshape(3, 2)
    _join_world_of_one()
    try:
        old = DeviceMesh.from_group(dist.new_group([0]), "cpu")  # group "1", equal to the next world's mesh
        distribute_tensor(whole, old, [Shard(0)]) * 2
    finally:
        destroy_distributed()
    _join_world_of_one()
    try:
        dist.new_group([0])  # "1" again: a group of this world under the old mesh's name
        mesh = init_device_mesh("cpu", (1,))
        doubled = distribute_tensor(whole, mesh, [Shard(0)]) * 2
        group = doubled.device_mesh.get_group()
        assert group is mesh.get_group(), f"the product's mesh communicates on group {group.group_name}, " \
                                          f"its operand's on {mesh.get_group().group_name}"
        assert torch.equal(doubled.full_tensor(), whole * 2)
    finally:
        destroy_distributed()


def _report_worker(info: RankInfo, out_dir: Path) -> None:
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    fields = {"rank": info.rank, "world": info.world_size, "local_rank": info.local_rank,
              "launcher": info.launcher, "backend": info.backend, "device": str(info.device),
              "sum": total.item(), "group_size": dist.get_world_size()}
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(fields))


@pytest.mark.slow
def test_spawn_local_runs_one_real_group(tmp_path: Path) -> None:
    spawn_local(_report_worker, 3, tmp_path, pcfg=ParallelConfig(dp=3, backend="auto"))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for r, rep in enumerate(reports):
        assert rep == {"rank": r, "world": 3, "local_rank": r, "launcher": "spawn", "backend": "gloo",
                       "device": "cpu", "sum": 6.0, "group_size": 3}


def _raising_worker(info: RankInfo) -> None:
    for step in range(1000):
        dist.all_reduce(torch.ones(4))
        if info.rank == 1 and step == 3:
            raise ValueError("boom at step 3")


@pytest.mark.timeout(90)  # a hang guard, not a timing assertion: the job must end on its own
@pytest.mark.slow
def test_rank_raising_mid_training_fails_job_naming_rank() -> None:
    with pytest.raises(GptparError, match=r"^rank 1 failed: ValueError: boom at step 3$"):
        spawn_local(_raising_worker, 2, pcfg=ParallelConfig(dp=2, backend="gloo", timeout_s=60))


def _hanging_worker(info: RankInfo) -> None:
    if info.rank == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(4))


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_hung_rank_fails_job_after_timeout() -> None:
    # Rank 0's all-reduce gives up after parallel.timeout_s; its failure then takes rank 1 down.
    with pytest.raises(GptparError, match=r"^rank 0 failed: .*Timed out waiting 3000ms"):
        spawn_local(_hanging_worker, 2, pcfg=ParallelConfig(dp=2, backend="gloo", timeout_s=3))


def _hanging_in_subgroups_worker(info: RankInfo) -> None:
    from datetime import timedelta

    from gptpar.parallel.pipeline.engine.executor import tied_group

    groups = {"tied": tied_group(ParallelDims.build(info, {"pp": 2})),
              "hpz block": ParallelDims.build(info, {"dp": 2}).block_group("dp", 2),
              **ParallelDims.build(info, {"cp": 2}).composites}
    if info.rank == 1:
        time.sleep(3600)
    assert {name: group._get_backend(info.device).options._timeout for name, group in groups.items()} == dict.fromkeys(
        groups, timedelta(seconds=3))
    dist.all_reduce(torch.ones(4), group=groups["tied"])


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_rank_hung_in_a_subgroup_fails_the_job_after_the_worlds_timeout() -> None:
    """The pipeline's tied-embedding group, hpz's node block and the grid's composites are made by dist.new_group,
    whose timeout is its backend's 30 minutes unless given the world's (a pp run once hung in the tied all-reduce)."""
    with pytest.raises(GptparError, match=r"^rank 0 failed: .*Timed out waiting 3000ms"):
        spawn_local(_hanging_in_subgroups_worker, 2, pcfg=ParallelConfig(pp=2, backend="gloo", timeout_s=3))


def test_grid_coordinates_are_row_major_with_tp_fastest() -> None:
    sizes = {"pp": 2, "dp": 3, "tp": 2, "ep": 1}
    coords = [coordinates(r, sizes) for r in range(12)]
    assert coords[0] == {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0}
    # tensor-parallel neighbours are consecutive ranks
    assert coords[1] == {"pp": 0, "dp": 0, "cp": 0, "tp": 1, "ep": 0}
    assert coords[2] == {"pp": 0, "dp": 1, "cp": 0, "tp": 0, "ep": 0}
    assert coords[11] == {"pp": 1, "dp": 2, "cp": 0, "tp": 1, "ep": 0}
    assert len({tuple(c.values()) for c in coords}) == 12


def test_context_parallel_ranks_sit_between_dp_and_tp_and_sync_over_dp_x_cp() -> None:
    """dp=2 x cp=2 x tp=2 (8 ranks, tp fastest, then cp): the cp group of rank 5 (dp 1, cp 0, tp 1) is its
    neighbour two ranks on; the gradients' group dp x cp every rank of its tp coordinate."""
    sizes = {"pp": 1, "dp": 2, "cp": 2, "tp": 2, "ep": 1}
    assert coordinates(5, sizes) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1, "ep": 0}
    assert group_ranks(5, sizes, "cp") == [5, 7]
    assert group_ranks(5, sizes, DP_CP) == [1, 3, 5, 7]
    assert composite_groups(sizes)[DP_CP] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert DP_CP not in composite_groups(sizes | {"cp": 1})  # the sync's group is then dp's own


def test_the_expert_dimension_splits_dp_into_groups_of_neighbouring_replicas() -> None:
    """ep=2 inside dp=4 (tp=2, 8 ranks): a rank's ep coordinate is dp % 2; its ep group the two replicas of its
    pair, its expert replicas those with its ep coordinate; no new rank."""
    sizes = {"pp": 1, "dp": 4, "tp": 2, "ep": 2}
    assert [coordinates(r, sizes)["ep"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert group_ranks(5, sizes, "ep") == [5, 7]  # dp 2 and 3, tp 1
    assert group_ranks(3, sizes, "ep") == [1, 3]  # dp 0 and 1, tp 1
    assert group_ranks(2, sizes, EXPERT_REPLICAS) == [2, 6]  # dp 1 and 3: both hold the second half
    assert group_ranks(4, sizes, EXPERT_REPLICAS) == [0, 4]
    assert group_ranks(5, sizes, "dp") == [1, 3, 5, 7]
    with pytest.raises(GptparError, match="ep=3 does not divide dp=4"):
        ParallelDims.build(_cpu_rank(0, 8), {**sizes, "ep": 3})


@pytest.mark.parametrize(("sizes", "expected"), [
    # dp=4 x tp=2 (rank = 2 dp + tp), ep=2: pairs of neighbouring replicas share experts; dp 0 and 2 (1 and 3) hold
    # the same ones.
    ({"pp": 1, "dp": 4, "tp": 2, "ep": 2}, {"ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
                                            EXPERT_REPLICAS: [[0, 4], [1, 5], [2, 6], [3, 7]]}),
    # pp=2 x dp=4 (rank = 4 pp + dp), ep=4: one expert group per stage, each replica alone with its experts.
    ({"pp": 2, "dp": 4, "tp": 1, "ep": 4}, {"ep": [[0, 1, 2, 3], [4, 5, 6, 7]]}),
    ({"pp": 2, "dp": 4, "tp": 1, "ep": 1}, {}),  # no expert parallelism: no composite
    # dp=4 x cp=2 (rank = 2 dp + cp), ep=2: an ep group shares its cp coordinate (each rank sends its shard's tokens
    # to the experts of its peers in the group), the experts' replicas span both cp coordinates.
    ({"pp": 1, "dp": 4, "cp": 2, "tp": 1, "ep": 2}, {"ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
                                                     EXPERT_REPLICAS: [[0, 1, 4, 5], [2, 3, 6, 7]],
                                                     DP_CP: [[0, 1, 2, 3, 4, 5, 6, 7]]}),
])
def test_named_composite_groups_are_a_function_of_the_grid(sizes: dict[str, int], expected: dict) -> None:
    """ISSUE 47.5: the groups ParallelDims makes once and names (grid.COMPOSITES), on 8-rank grids, every rank's own
    group among them (as ParallelDims.group_ranks gives it)."""
    made = composite_groups(sizes)
    assert made == expected
    for name, groups in made.items():
        for rank in range(8):
            assert group_ranks(rank, sizes, name) in groups


def _cpu_rank(rank: int, world_size: int) -> RankInfo:
    return RankInfo("single", rank, world_size, 0, 1, "127.0.0.1", 29500, "gloo", torch.device("cpu"))


def test_grid_refuses_a_shape_that_does_not_fill_the_job() -> None:
    with pytest.raises(GptparError, match=r"rank grid pp=1 x dp=3 x cp=1 x tp=1 needs 3 ranks but the job has 4"):
        ParallelDims.build(_cpu_rank(0, 4), {"dp": 3})
    with pytest.raises(GptparError, match="unknown dimension"):
        ParallelDims.build(_cpu_rank(0, 2), {"sp": 2})
    alone = ParallelDims.build(_cpu_rank(0, 1), {"dp": 1})
    assert alone.sizes == {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1}
    assert alone.group("dp") is None and alone.mesh is None
    assert alone.group("ep") is None and alone.group(EXPERT_REPLICAS) is None


def _grid_worker(info: RankInfo, sizes: dict[str, int], out_dir: Path) -> None:
    grid = ParallelDims.build(info, sizes)
    members = {}
    for dim in ("pp", "dp", "tp", "ep", EXPERT_REPLICAS, "dp_pairs"):
        # dp_pairs: blocks of two consecutive dp coordinates, parallel.hpz's node groups of two
        group = grid.block_group("dp", 2) if dim == "dp_pairs" else grid.group(dim)
        if group is None:
            members[dim] = [info.rank]
            continue
        # Each rank contributes a one-hot of its global rank: the sum is exactly the group's membership.
        onehot = torch.zeros(info.world_size)
        onehot[info.rank] = 1
        dist.all_reduce(onehot, group=group)
        members[dim] = [r for r in range(info.world_size) if onehot[r] == 1]
    result = {"coords": grid.coords, "members": members,
              "group_ranks": {d: grid.group_ranks(d) for d in ("pp", "dp", "tp", "ep", EXPERT_REPLICAS)}}
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("sizes, expected", [
    ({"dp": 2, "tp": 2}, {0: ({"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0}, [0, 2], [0, 1]),
                          3: ({"pp": 0, "dp": 1, "cp": 0, "tp": 1, "ep": 0}, [1, 3], [2, 3])}),
    ({"pp": 2, "dp": 2}, {1: ({"pp": 0, "dp": 1, "cp": 0, "tp": 0, "ep": 0}, [0, 1], [1]),
                          2: ({"pp": 1, "dp": 0, "cp": 0, "tp": 0, "ep": 0}, [2, 3], [2])}),
    ({"dp": 4, "ep": 2}, {1: ({"pp": 0, "dp": 1, "cp": 0, "tp": 0, "ep": 1}, [0, 1, 2, 3], [1]),
                          2: ({"pp": 0, "dp": 2, "cp": 0, "tp": 0, "ep": 0}, [0, 1, 2, 3], [2])}),
])
@pytest.mark.slow
def test_four_rank_grid_gives_coordinates_and_groups_on_gloo(tmp_path: Path, sizes, expected,
                                                             gloo_pool: GlooPools) -> None:
    gloo_pool.run(4, _grid_worker, sizes, tmp_path)
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    for rank, (coords, dp_members, tp_members) in expected.items():
        assert results[rank]["coords"] == coords
        assert results[rank]["members"]["dp"] == dp_members == results[rank]["group_ranks"]["dp"]
        assert results[rank]["members"]["tp"] == tp_members == results[rank]["group_ranks"]["tp"]
        pair = dp_members.index(rank) // 2
        assert results[rank]["members"]["dp_pairs"] == dp_members[2 * pair:2 * pair + 2]
        # ep=2 inside dp=4: rank 1 shares experts with 0 and holds the same ones as 3; rank 2 with 3 and as 0.
        ep = sizes.get("ep", 1)
        want_ep = ([rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]) if ep == 2 else ([rank], [rank])
        assert (results[rank]["members"]["ep"], results[rank]["members"][EXPERT_REPLICAS]) == want_ep
        if ep == 2:
            assert results[rank]["group_ranks"]["ep"] == want_ep[0]
            assert results[rank]["group_ranks"][EXPERT_REPLICAS] == want_ep[1]
    pp_members = {tuple(r["members"]["pp"]) for r in results.values()}
    assert pp_members == ({(0, 2), (1, 3)} if sizes.get("pp") == 2 else {(0,), (1,), (2,), (3,)})
