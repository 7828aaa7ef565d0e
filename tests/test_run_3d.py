"""``tp-ext run`` laid out TP x PP x DP: the parallel flags and config fields with their rules
(checked before torch.distributed starts), the job on 8 local ranks (tp=2 x pp=2 x dp=2), on
4 ranks with FSDP2 and a V-shaped schedule, and on two torchrun "nodes" of one host."""

import os
import socket
import subprocess
import sys

import pytest

from tp_ext.cli import main
from tp_ext.config import JobConfig, ParallelSettings, job_dims
from tp_ext.models import ConfigError
from tp_ext.pipeline.schedules import weight_split_supported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "configs", "qwen2-mini.yaml")
SCHEDULES = "'GPipe', '1F1B', 'Interleaved1F1B', 'InterleavedZeroBubble', 'ZBVZeroBubble'"

CHECKS = (
    "ok   logits equal the single-process model",
    "ok   greedy tokens equal the single-process model",
    "ok   training loss is the same on every rank",
    "ok   training loss goes down at every step",
    "ok   training losses equal the single-process model trained on every replica's data",
    "ok   after training, every replica's logits equal the single-process model's",
    "ok   sharded DCP checkpoint reloads bitwise",
    "ok   after training, greedy tokens equal the single-process model's",
)


def _torchrun(launch: list[str], flags: list[str], timeout: int = 400, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "tp_ext", "run"]
    return subprocess.Popen(
        [*command, MINI, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,  # this checkout's tp_ext
        env=env,
        **kw,
    )


def _finish(proc, timeout: int = 400) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return -9, out, err
    return proc.returncode, out, err


def _assert_passed(out: str, err: str, world: int, dims: str) -> None:
    for line in CHECKS:
        assert line in out, out[-4000:] + err[-3000:]
    assert "FAIL" not in out
    assert f"all checks passed on {world} ranks (dims {dims}" in out, out[-3000:]


# -- the job under torchrun ----------------------------------------------------------------------


# in `make test-all` (40 s on 2 cores): the two-node job below runs the same 8-rank dims
@pytest.mark.full_matrix
def test_3d_job_on_8_local_ranks():
    proc = _torchrun(["--standalone", "--nproc-per-node", "8"], "--tp 2 --pp 2 --dp 2".split())
    code, out, err = _finish(proc)
    assert code == 0, out[-4000:] + err[-4000:]
    dims = (
        "tp=2 x pp=2 x dp=2 on 8 ranks; pipeline schedule 1F1B, 2 stages (1 per rank), "
        "2 micro-batches per step; data parallel ddp over 2 replicas"
    )
    _assert_passed(out, err, 8, dims)
    assert "tp-ext run: 8 ranks (tp=2, pp=2, dp=2)" in out
    assert "pp rank 0: stage 0 (layers 0-0, embedding); pp rank 1: stage 1 (layers 1-1, " in out
    assert "2 replicas, clip 1.0" in out
    # the rank table: global rank r is (tp, pp, dp) = (r % 2, r // 4, r // 2 % 2)
    for r in range(8):
        assert f"    {r:>4}  {r % 2:>2} {r // 4:>2} {r // 2 % 2:>2}  " in out, out


# make test-all (28 s): in make test, FSDP2, interleaving and recompute are test_pipeline's and
# test_pipeline_hf's in-process cases, and the command end to end is the two-node job below
@pytest.mark.full_matrix
def test_fsdp_and_an_interleaved_schedule_with_recompute_on_4_ranks():
    flags = (
        "--pp 2 --dp 2 --data-parallel fsdp --schedule Interleaved1F1B --virtual-stages 2 "
        "--activation-checkpointing --steps 3"
    )
    code, out, err = _finish(_torchrun(["--standalone", "--nproc-per-node", "4"], flags.split()))
    assert code == 0, out[-4000:] + err[-4000:]
    dims = (
        "tp=1 x pp=2 x dp=2 on 4 ranks; pipeline schedule Interleaved1F1B, 4 stages (2 per rank, "
        "loop order), 4 micro-batches per step; data parallel fsdp over 2 replicas; activation "
        "checkpointing on"
    )
    _assert_passed(out, err, 4, dims)
    # the tiny model gets a layer per stage; the loop order deals them out in turn
    assert "4 layers" in out
    assert "pp rank 0: stage 0 (layers 0-0, embedding), stage 2 (layers 2-2); pp rank 1" in out


@pytest.mark.full_matrix  # in-process at every schedule: test_pipeline's (1, 2, 2) ZBVZeroBubble
def test_zero_bubble_schedule_with_data_parallel_equals_the_reference():
    """Found by this job: zero-bubble schedules write weight gradients outside autograd's
    hooks, so DDP never reduced them; tp_ext.pipeline now averages them after the step."""
    flags = "--pp 2 --dp 2 --schedule ZBVZeroBubble --virtual-stages 2 --steps 2"
    code, out, err = _finish(_torchrun(["--standalone", "--nproc-per-node", "4"], flags.split()))
    assert code == 0 and "FAIL" not in out, out[-4000:] + err[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# make test: 2 ranks per node (tp=2 inside, the pipeline across); make test-all: 4 per node, two
# replicas too (58 s on 2 cores)
@pytest.mark.parametrize(
    "per_node", [2, pytest.param(4, marks=pytest.mark.full_matrix)], ids=["4-ranks", "8-ranks"]
)
def test_two_nodes_on_one_host(tmp_path, per_node):
    """Two torchrun agents (--nnodes 2, c10d rendezvous): tp=2 x pp=2 (x dp=2 with 4 ranks per
    node), tp inside a node, the pipeline across the nodes in the V order (rank 0 holds the
    first and last stage)."""
    port = _free_port()
    dp = per_node // 2
    procs = [
        _torchrun(
            [
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(per_node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"tp-ext-run-{port}",
            ],
            ["--tp", "2", "--pp", "2", "--dp", str(dp), "--schedule", "DualPipeV"]
            + ["--virtual-stages", "2", "--steps", "3", "--workdir", str(tmp_path / "work")],
        )
        for node in (0, 1)
    ]
    results = [_finish(p) for p in procs]
    both = "\n".join(out + err for _, out, err in results)
    assert [code for code, _, _ in results] == [0, 0], both[-6000:]
    out = "".join(out for _, out, _ in results)  # global rank 0 prints, on either node
    world = 2 * per_node
    dims = f"tp=2 x pp=2 x dp={dp} on {world} ranks; pipeline schedule DualPipeV, 4 stages"
    _assert_passed(out, "", world, dims)
    assert f"tp-ext run: {world} ranks (tp=2, pp=2, dp={dp})" in out
    assert "pp rank 0: stage 0 (layers 0-0, embedding), stage 3 (layers 3-3, norm + lm_head)" in out
    if dp > 1:
        assert "data parallel ddp over 2 replicas" in out and "2 replicas, clip 1.0" in out
    # the rank table: global rank r is (tp, pp, dp) = (r % 2, r // (2 dp), r // 2 % dp)
    for r in range(world):
        assert f"    {r:>4}  {r % 2:>2} {r // (2 * dp):>2} {r // 2 % dp:>2}  " in out, out
    assert os.path.isdir(tmp_path / "work" / "sharded")


# -- rules, before torch.distributed starts --------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--schedule", "bogus"], "argument --schedule: invalid choice: 'bogus' (choose from "),
        (["--data-parallel", "zero"], "argument --data-parallel: invalid choice: 'zero'"),
        (["--pp", "0"], "argument --pp: must be an integer in [1, 65,536], got '0'"),
        (["--virtual-stages", "0"], "argument --virtual-stages: must be an integer in [1, 64]"),
        (["--virtual-stages", "1.5"], "argument --virtual-stages: must be an integer in [1, 64]"),
        (["--micro-batches", "2000"], "argument --micro-batches: must be an integer in [1, 1,024]"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)
def test_bad_parallel_flag_values_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", MINI, *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"tp-ext run: error: {message}" in err, err
    if flags[0] == "--schedule":
        assert SCHEDULES in err and "'DualPipeV'" in err


@pytest.mark.parametrize(
    "world, flags, message",
    [
        (
            8,
            ["--tp", "2", "--pp", "3"],
            "--pp 3 does not fit the 8 ranks (WORLD_SIZE): tp x pp x dp must equal 8 (with "
            "tp=2); --pp values that work: [1, 2, 4]",
        ),
        (
            8,
            ["--tp", "2", "--pp", "2", "--dp", "3"],
            "--dp 3 does not fit the 8 ranks (WORLD_SIZE): tp x pp x dp must equal 8 (with "
            "pp=2, tp=2); --dp values that work: [2]",
        ),
        (
            8,
            ["--pp", "2", "--dp", "2", "--tp", "4"],
            "--tp 4 does not fit the 8 ranks (WORLD_SIZE): tp x pp x dp must equal 8 (with "
            "pp=2, dp=2); --tp values that work: [2]",
        ),
        (
            6,
            ["--pp", "4"],
            "--pp 4 does not fit the 6 ranks (WORLD_SIZE): tp x pp x dp must equal 6; --pp "
            "values that work: [1, 2, 3, 6]",
        ),
        (
            2,
            ["--pp", "2", "--schedule", "ZBVZeroBubble"],
            "--schedule 'ZBVZeroBubble' needs virtual_stages=2, stage_order='v' (rank r holds "
            "stages r and 2*pp-1-r); got parallel.virtual_stages 1, with which these schedules "
            "work: ['GPipe', '1F1B', 'Interleaved1F1B', 'InterleavedZeroBubble']",
        ),
        (
            2,
            ["--pp", "2", "--virtual-stages", "2"],
            "parallel.schedule '1F1B' needs virtual_stages=1 (one stage per rank); got "
            "--virtual-stages 2, with which these schedules work: ['Interleaved1F1B', "
            "'InterleavedZeroBubble', 'ZBVZeroBubble', 'DualPipeV']",
        ),
        (
            2,
            ["--pp", "2", "--micro-batches", "1"],
            "--micro-batches 1 does not fit --pp 2 x parallel.virtual_stages 1: schedule '1F1B' "
            "with 2 stages needs at least 2 (one per stage) micro-batches; values that work "
            "include [2, 3, 4, 5, 6, 7]",
        ),
        (
            2,
            ["--pp", "2", "--virtual-stages", "2", "--schedule", "Interleaved1F1B"]
            + ["--micro-batches", "5"],
            "--micro-batches 5 does not fit --pp 2 x --virtual-stages 2: schedule "
            "'Interleaved1F1B' with 4 stages needs a multiple of max(1, n // pp) (pp=2), e.g. 2, "
            "4 or 6 micro-batches; values that work include [1, 2, 3, 4, 6, 8]",
        ),
        (
            4,
            ["--pp", "4", "--small", MINI],
            f"--small {MINI}: its 2 decoder layers cannot fill --pp 4 x parallel.virtual_stages "
            "1 = 4 pipeline stages (each needs a layer); give a model of at least 4 layers",
        ),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else "" if isinstance(x, str) else f"world{x}",
)
def test_dims_that_cannot_run_exit_2_naming_the_flag(world, flags, message, capsys, monkeypatch):
    """Values each flag allows alone, wrong together or for the world size: exit 2 before
    torch.distributed starts (which would fail here: WORLD_SIZE is set, torchrun is not)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert main(["run", MINI, *flags]) == 2
    err = capsys.readouterr().err
    assert f"tp-ext run: {message}" in err, err


def test_degrees_fill_what_is_left():
    def degrees(world, tp=None, **parallel):
        dims = job_dims(ParallelSettings(**parallel), {"tp": tp}, world)
        return dims.tp, dims.pp, dims.dp

    assert degrees(8) == (8, 1, 1)  # TP takes every rank, as before
    assert degrees(8, pp=2) == (4, 2, 1)
    assert degrees(8, tp=2, pp=2) == (2, 2, 2)  # DP takes the rest
    assert degrees(8, pp=2, dp=2) == (2, 2, 2)
    assert degrees(8, tp=1, dp=2, pp=4) == (1, 4, 2)
    with pytest.raises(ValueError, match=r"parallel.dp 3 does not fit the 8 ranks"):
        degrees(8, dp=3)  # from the config file: named as its field


def test_parallel_section_fields_and_rules(tmp_path):
    job = JobConfig.from_file(MINI)
    assert (job.parallel.schedule, job.parallel.virtual_stages) == ("1F1B", 1)
    assert (job.parallel.data_parallel, job.parallel.activation_checkpointing) == ("ddp", False)
    assert job.parallel.micro_batches is None and job.parallel.pipeline_micro_batches == 2
    v_job = dict(pp=4, schedule="DualPipeV", virtual_stages=2, data_parallel="fsdp")
    if weight_split_supported():
        v = job.with_overrides(**v_job)
        assert (v.parallel.stage_order, v.parallel.pipeline_micro_batches) == ("v", 8)
    else:  # every V schedule is a zero-bubble one, refused on this torch
        with pytest.raises(ConfigError, match=r"^parallel.schedule: schedule 'DualPipeV' splits"):
            job.with_overrides(**v_job)
    assert job.with_overrides(pp=2, micro_batches=6).parallel.pipeline_micro_batches == 6
    with pytest.raises(ConfigError, match=r"parallel.micro_batches 1 does not fit parallel.pp 2"):
        job.with_overrides(pp=2, micro_batches=1)
    with pytest.raises(ConfigError, match="parallel.data_parallel must be one of ddp, fsdp"):
        job.with_overrides(data_parallel="zero")
    text = open(MINI).read().replace("  pp: 1\n", "  pp: 2\n  schedule: DualPipeV\n")
    (tmp_path / "v.yaml").write_text(text)
    with pytest.raises(
        ConfigError,
        match=r"v.yaml: parallel.schedule 'DualPipeV' needs virtual_stages=2, stage_order='v'.*"
        r"got parallel.virtual_stages 1",
    ):
        JobConfig.from_file(str(tmp_path / "v.yaml"))
    (tmp_path / "c.yaml").write_text(
        open(MINI).read().replace("  pp: 1\n", "  activation_checkpointing: yes please\n")
    )
    with pytest.raises(ConfigError, match="parallel.activation_checkpointing must be true or"):
        JobConfig.from_file(str(tmp_path / "c.yaml"))
