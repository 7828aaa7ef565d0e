"""The machine a plan is for: device FLOP/s, memory bandwidth and the two link speeds (inside a
node, across nodes), from a small table of datasheet figures, or measured on this machine by
:func:`calibrate` (CPU ranks talking over gloo, what the tests run on)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

from tp_ext.layers.loss import vocab_parallel_cross_entropy
from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from tp_ext.planner.counts import forward_backward_work

__all__ = ["Hardware", "HARDWARE", "calibrate", "calibration_path", "load_hardware"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """``flops``: dense bf16 FLOP/s one device reaches in large GEMMs (datasheet peak times
    ``efficiency``); ``memory_bandwidth``: bytes/s of device memory; ``intra_node`` /
    ``inter_node``: bus bandwidth per device of a collective (bytes/s) inside a node (NVLink,
    PCIe) and across nodes (InfiniBand); ``latency``: seconds per collective call."""

    name: str
    flops: float
    memory_bandwidth: float
    intra_node: float
    inter_node: float
    latency: float
    memory: Optional[int] = None  # bytes per device, when the table knows it
    # AdamW's implementation: tp_ext's build_optimizer takes the fused kernel on GPUs (no
    # temporaries); on CPU torch's per-tensor loop (two temporaries of the largest tensor)
    fused_optimizer: bool = True
    # seconds each operator costs beyond its FLOPs (dispatch and launch; on GPUs mostly hidden
    # behind the previous kernel, on CPU paid in full)
    op_overhead: float = 2e-6
    # whether collectives run beside compute (GPUs: NCCL on its own stream and copy engines);
    # CPU ranks over gloo share their cores with it, so nothing overlaps there
    overlap: bool = True
    # the engines' own cost per event, beyond the bytes and FLOPs they move: torch's pipelining
    # runtime per schedule action (one stage's forward or backward of one micro-batch, with its
    # sends and receives posted), and FSDP2 per unit and micro-batch (its hooks, the copy in
    # and out of the flat buffers and the collectives' calls)
    pp_action_overhead: float = 50e-6
    fsdp_unit_overhead: float = 300e-6
    # bus bandwidth of a reduce-scatter (bytes/s) where it differs from the link's (gloo's is
    # far slower than its all-reduce); None: the link's
    reduce_scatter: Optional[float] = None
    # seconds of AdamW's step per parameter, when measured (CPU: torch's per-tensor loop is
    # several passes of arithmetic, not one of memory); else from the bytes it moves
    optimizer_seconds_per_param: Optional[float] = None

    def link(self, crosses_nodes: bool) -> float:
        return self.inter_node if crosses_nodes else self.intra_node


GB = 1e9
GiB = 1024**3
# Datasheet figures; GEMMs reach about half of peak in training (Megatron reports 40-55% MFU).
# Links: NVLink 4 (H100/H200) 450 GB/s and NVLink 3 (A100) 300 GB/s per direction, of which
# collectives reach ~80%; InfiniBand NDR 400 Gb/s (HDR 200 Gb/s) per GPU; PCIe 5 x16 64 GB/s.
HARDWARE = {
    "h100": Hardware("NVIDIA H100 SXM (NVLink 4, IB NDR)", 989e12 * 0.5, 3.35e12, 360 * GB,
                     45 * GB, 10e-6, 80 * GiB),
    "h200": Hardware("NVIDIA H200 SXM (NVLink 4, IB NDR)", 989e12 * 0.5, 4.8e12, 360 * GB,
                     45 * GB, 10e-6, 141 * GiB),
    "a100": Hardware("NVIDIA A100 SXM 80GB (NVLink 3, IB HDR)", 312e12 * 0.5, 2.0e12, 240 * GB,
                     22 * GB, 10e-6, 80 * GiB),
    "h100-pcie": Hardware("NVIDIA H100 PCIe (PCIe 5, IB NDR)", 756e12 * 0.5, 2.0e12, 50 * GB,
                          45 * GB, 15e-6, 80 * GiB),
    # a 2-core VM running one intra-op thread per rank; `tp-ext plan --calibrate` measures it
    "cpu": Hardware("CPU ranks over gloo (defaults; run tp-ext plan --calibrate)", 20e9, 5e9,
                    1 * GB, 1 * GB, 100e-6, None, False, 30e-6, False, 2e-3, 5e-3),
}  # fmt: skip


def calibration_path() -> str:
    """Where :func:`calibrate` keeps its measurement (``TP_EXT_CALIBRATION`` overrides)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "tp_ext", "planner-cpu.json")
    return os.environ.get("TP_EXT_CALIBRATION", default)


def load_hardware(name: str) -> Hardware:
    """``name`` from :data:`HARDWARE`; "cpu" takes the calibration file's numbers when there is
    one."""
    if name not in HARDWARE:
        raise ValueError(f"hardware={name!r} is not in the table; use one of {sorted(HARDWARE)}")
    if name == "cpu" and os.path.exists(calibration_path()):
        with open(calibration_path()) as f:
            measured = json.load(f)
        fields = {f.name for f in dataclasses.fields(Hardware)}
        return dataclasses.replace(
            HARDWARE["cpu"], **{k: measured[k] for k in fields & set(measured)}
        )
    return HARDWARE[name]


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _decoder_rate_and_overhead(torch) -> tuple:
    """(FLOP/s, seconds per operator) of tp_ext's own decoder on this machine, as the planner
    charges it (operators x overhead + FLOPs / rate): the overhead from a Qwen2 too small to
    compute anything (dispatch, autograd nodes, module calls: microseconds each on CPU), the
    rate from a small Qwen2's forward + backward at 1 and 4 sequences of 128 tokens less that
    overhead. (A large matmul's rate alone overstates it: GEMMs of a few hundred rows and the
    elementwise work between them run well below it.)"""

    def seconds(config, b, seq):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (b, seq))

        def run():
            logits = model(ids)
            vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], reduction="sum").backward()

        run()  # warm up
        return _median_seconds(run, 7)

    small = dict(
        vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-6,
    )  # fmt: skip
    tiny = dict(small, vocab_size=16, hidden_size=16, intermediate_size=16, num_attention_heads=2)
    tiny = Qwen2Config(**dict(tiny, num_key_value_heads=1))
    _, tiny_ops = forward_backward_work(tiny, 1, 4)
    overhead = seconds(tiny, 1, 4) / tiny_ops
    config = Qwen2Config(**small)
    flops = time_of_flops = 0.0
    for b in (1, 4):
        f, ops = forward_backward_work(config, b, 128)
        flops += f
        time_of_flops += max(seconds(config, b, 128) - ops * overhead, 1e-9)
    return flops / time_of_flops, overhead


def _worker(rank: int, world: int, path: str, out) -> None:
    """Every rank measures at once, as ranks train at once (cores shared, memory bandwidth
    split): a copy, tp_ext's decoder (FLOP/s and per-operator cost), then gloo's all-reduce
    and reduce-scatter, AdamW, and the pipelining and FSDP2 runtimes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        src = torch.randn(8 * 1024 * 1024 // 4)
        dst = torch.empty_like(src)
        dist.barrier()
        copy = 2 * src.numel() * 4 / _median_seconds(lambda: dst.copy_(src), 20)
        flops, overhead = _decoder_rate_and_overhead(torch)
        small, big = torch.zeros(1), torch.zeros(4 * 1024 * 1024 // 4)  # 4 B and 4 MiB
        for t in (small, big):
            dist.all_reduce(t)  # warm up
        latency = _median_seconds(lambda: dist.all_reduce(small), 50)
        seconds = _median_seconds(lambda: dist.all_reduce(big), 10)
        bus = 2 * (world - 1) / world * big.numel() * 4  # ring all-reduce bytes per rank
        shard = torch.zeros(big.numel() // world)
        dist.reduce_scatter_tensor(shard, big)  # warm up
        scatter_s = _median_seconds(lambda: dist.reduce_scatter_tensor(shard, big), 10)
        scatter_bus = (world - 1) / world * big.numel() * 4
        adamw = _adamw_seconds_per_param(torch)
        action = _pipeline_seconds_per_action(torch, rank, world)
        unit = _fsdp_seconds_per_unit(torch, world)
        if rank == 0:
            out.put((flops, copy, overhead, latency, bus / max(seconds - latency, 1e-9)))
            out.put((action, unit, adamw, scatter_bus / max(scatter_s - latency, 1e-9)))
    finally:
        dist.destroy_process_group()


def _adamw_seconds_per_param(torch) -> float:
    """torch.optim.AdamW's step (the Trainer's optimizer on CPU) over 2M parameters in 4
    tensors, per parameter."""
    params = [torch.nn.Parameter(torch.randn(1 << 19)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params, lr=1e-4)
    adamw.step()  # the moments exist from the first step on
    return _median_seconds(adamw.step, 5) / (4 << 19)


def _pipeline_seconds_per_action(torch, rank: int, world: int) -> float:
    """torch.distributed.pipelining's cost per schedule action: a 1F1B step of tiny stages (one
    8 x 8 linear each) over many micro-batches, whose FLOPs are nothing."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    n = 16

    def activation(requires_grad: bool):
        return torch.empty(1, 8, device="meta", requires_grad=requires_grad)

    # as tp_ext's PipelineRunner builds them (shapes given, the activations' requires_grad set,
    # the loss function on every rank): torch 2.11 runs a rank whose schedule has no loss
    # function as inference, and a step with it there but these left out hung or failed
    stage = PipelineStage(
        torch.nn.Linear(8, 8), rank, world, torch.device("cpu"),
        input_args=activation(rank > 0), output_args=activation(True),
    )  # fmt: skip
    schedule = Schedule1F1B(stage, n, loss_fn=lambda out, target: out.sum(), scale_grads=False)
    x = torch.ones(n, 8)
    args = (x,) if rank == 0 else ()
    target = x if rank == world - 1 else None

    def step():
        schedule.step(*args, target=target, return_outputs=False)
        torch.distributed.barrier()

    step()  # the first step also sets the stages' shapes up
    return _median_seconds(step, 5) / (2 * n)


def _fsdp_seconds_per_unit(torch, world: int) -> float:
    """FSDP2's cost per unit and micro-batch beyond its bytes: a forward + backward of 8 tiny
    linears, each its own fully_shard unit, against the same model without FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    units = 8

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(units)])

    plain, sharded = model(), model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.ones(2, 8)

    def step(m):
        def run():
            m(x).sum().backward()
            torch.distributed.barrier()

        return run

    for m in (plain, sharded):
        step(m)()
    return max(_median_seconds(step(sharded), 5) - _median_seconds(step(plain), 5), 0) / (units + 1)


def calibrate(path: Optional[str] = None) -> Hardware:
    """Measure this machine as the planner's "cpu" hardware: two ranks of one intra-op thread
    each (as the tests and the CPU benchmarks run), measuring at the same time: a copy's
    bytes/s, the FLOP/s and fixed cost per operator of tp_ext's decoder, a gloo all-reduce's
    latency and bus bandwidth and a reduce-scatter's, AdamW's step per parameter, and the
    pipelining runtime's and FSDP2's own costs; written as JSON to ``path`` (default
    :func:`calibration_path`) and returned."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, 2, store, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        if any(p.exitcode != 0 for p in procs):
            for p in procs:  # a rank that hangs is not left behind
                if p.is_alive():
                    p.kill()
            raise RuntimeError(
                "tp-ext plan --calibrate: the 2-rank measurement failed (exit codes "
                f"{[p.exitcode for p in procs]}; None: still running after 300 s, killed)"
            )
        flops, copy, overhead, latency, bandwidth = out.get(timeout=10)
        action, unit, adamw, scatter = out.get(timeout=10)
    measured = dataclasses.replace(
        HARDWARE["cpu"],
        name="CPU ranks over gloo (measured by tp-ext plan --calibrate)",
        flops=flops,
        memory_bandwidth=copy,
        intra_node=bandwidth,
        inter_node=bandwidth,
        latency=latency,
        op_overhead=overhead,
        pp_action_overhead=action,
        fsdp_unit_overhead=unit,
        reduce_scatter=scatter,
        optimizer_seconds_per_param=adamw,
    )
    path = path or calibration_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(measured), f, indent=2)
    return measured
