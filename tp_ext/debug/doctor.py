"""doctor: the environment tp_ext runs in, and what in it would fail (``tp-ext doctor``)."""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import sys

import torch
import torch.distributed as dist

__all__ = ["Check", "doctor"]

OK, WARN, FAIL = "ok", "warn", "fail"
SHM_MIN_BYTES = 256 << 20  # below this the shared-memory channel and DataLoader workers suffer


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str


def _release(version: str) -> tuple[int, ...]:
    core = version.split("+")[0]
    return tuple(int(p) for p in core.split(".")[:2] if p.isdigit())


def _extension() -> list[Check]:
    try:
        from tp_ext import ops
    except Exception as e:  # noqa: BLE001 (reported, not raised: this is the diagnosis)
        return [Check("tp_ext extension", FAIL, f"does not load: {type(e).__name__}: {e}")]
    built = ops._C._built_with_torch()
    running = torch.__version__
    checks = [Check("tp_ext extension", OK, f"loaded, {len(ops.ALL_OPS)} ops registered")]
    if _release(built) != _release(running):
        checks.append(
            Check(
                "torch version",
                FAIL,
                f"tp_ext was built with torch {built}, this is torch {running}: C++ ABI and op "
                "schemas may not match; rebuild (pip install -e . or make install)",
            )  # fmt: skip
        )
    else:
        checks.append(Check("torch version", OK, f"{running} (tp_ext built with {built})"))
    # CUDA kernels are registered only by a CUDA build
    cuda_kernels = torch._C._dispatch_has_kernel_for_dispatch_key("tp_ext::rms_norm", "CUDA")
    if torch.cuda.is_available() and not cuda_kernels:
        checks.append(
            Check(
                "CUDA kernels",
                FAIL,
                "a GPU is here but tp_ext was built without CUDA: its ops fail on CUDA tensors; "
                "rebuild where nvcc is found (TP_EXT_CUDA=1 forces it)",
            )  # fmt: skip
        )
    else:
        checks.append(
            Check("CUDA kernels", OK, "built" if cuda_kernels else "not built (CPU only)")
        )
    return checks


def _cuda() -> list[Check]:
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return [Check("CUDA", OK, "no GPU visible (a CPU build of torch)")]
        return [Check("CUDA", WARN, f"no GPU visible (torch built with CUDA {torch.version.cuda})")]
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    checks = [Check("CUDA", OK, f"CUDA {torch.version.cuda}, {len(names)} GPU(s): {names}")]
    try:
        version = torch.cuda.nccl.version()  # a tuple, or an int in older torch
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        checks.append(Check("NCCL", OK, f"NCCL {nccl}"))
    except Exception as e:  # noqa: BLE001
        checks.append(Check("NCCL", FAIL, f"not usable ({e}): multi-GPU TP needs it"))
    return checks


def _backends() -> list[Check]:
    if not dist.is_available():
        return [Check("torch.distributed", FAIL, "this torch was built without it")]
    have = [name for name, ok in (("gloo", dist.is_gloo_available()),
                                  ("nccl", dist.is_nccl_available()),
                                  ("mpi", dist.is_mpi_available())) if ok]  # fmt: skip
    status = OK if "gloo" in have else FAIL
    why = "" if status == OK else ": CPU ranks (tests, the demo) need gloo"
    checks = [Check("backends", status, f"available: {', '.join(have) or 'none'}{why}")]
    if torch.cuda.device_count() > 1 and "nccl" not in have:
        checks.append(Check("backends", FAIL, "several GPUs but no NCCL: TP across them fails"))
    return checks


def _shared_memory() -> list[Check]:
    if not os.path.isdir("/dev/shm"):
        return [Check("shared memory", WARN, "/dev/shm is missing: tp_ext's same-host channel is "
                      "off and small collectives take gloo's sockets")]  # fmt: skip
    usage = shutil.disk_usage("/dev/shm")
    detail = f"/dev/shm {usage.total >> 20} MiB, {usage.free >> 20} MiB free"
    if usage.free < SHM_MIN_BYTES:
        return [Check("shared memory", WARN, detail + f" (under {SHM_MIN_BYTES >> 20} MiB: "
                      "containers often need --shm-size=1g)")]  # fmt: skip
    switch = os.environ.get("TP_EXT_SHM")
    note = "; TP_EXT_SHM=0 turns the channel off" if switch == "0" else ""
    return [Check("shared memory", OK, detail + note)]


def _variables() -> list[Check]:
    """tp_ext's own environment variables, parsed by the code that reads them at run time."""
    try:
        from tp_ext import ops
    except Exception:  # noqa: BLE001 (the extension check reports it)
        return []
    error = ops._C._env_error()
    if error:
        return [Check("TP_EXT_* variables", FAIL, error.replace("\n", "; "))]
    set_here = sorted(k for k in os.environ if k.startswith("TP_EXT_"))
    return [Check("TP_EXT_* variables", OK, ", ".join(set_here) if set_here else "none set")]


def _launch() -> list[Check]:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    present = {k: os.environ[k] for k in keys if k in os.environ}
    if not present:
        return [Check("launcher", OK, "not under torchrun (single process)")]
    missing = [k for k in keys if k not in present and k != "LOCAL_RANK"]
    if missing:
        return [Check("launcher", FAIL, f"torchrun variables incomplete: {missing} missing, "
                      f"have {sorted(present)}; launch with torchrun")]  # fmt: skip
    return [Check("launcher", OK, ", ".join(f"{k}={v}" for k, v in present.items()))]


def doctor() -> list[Check]:
    """Every check, in order: Python and platform, the extension against the running torch,
    CUDA and NCCL, the distributed backends, shared memory, tp_ext's own variables, the
    launcher's variables."""
    checks = [Check("python", OK, f"{platform.python_version()} on {platform.platform()}")]
    if sys.version_info < (3, 10):
        checks[0] = Check("python", FAIL, f"{platform.python_version()}: tp_ext needs >= 3.10")
    for part in (_extension, _cuda, _backends, _shared_memory, _variables, _launch):
        checks += part()
    return checks
