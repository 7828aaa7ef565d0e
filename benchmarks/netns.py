"""Ranks on a throttled link: each of two gloo ranks in its own network namespace, joined by a
veth pair whose two ends are limited by tc's token bucket filter (tbf) to ``mbit`` Mbit/s.

Needs root and iproute2 (``ip netns``, ``tc``); :func:`why_not` says what is missing. The
rendezvous is a file (the namespaces share the filesystem); gloo's traffic takes the veth
(GLOO_SOCKET_IFNAME), so every byte of the collectives crosses the throttled link.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager

PREFIX = "tpext"  # namespace and interface names: tpext0 / tpext1, veths tpextv0 / tpextv1
SUBNET = "10.231.7"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def why_not() -> str:
    """Empty when namespaces with tc can be made here; else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    try:
        _ip("netns", "add", f"{PREFIX}probe")
        _ip("netns", "del", f"{PREFIX}probe")
    except subprocess.CalledProcessError as e:
        return f"ip netns add failed: {e.stderr.strip()}"
    return ""


def _teardown() -> None:
    for r in range(2):
        subprocess.run(["ip", "netns", "del", f"{PREFIX}{r}"], capture_output=True)


@contextmanager
def throttled_pair(mbit: float):
    """Two namespaces joined by a veth pair limited to ``mbit`` Mbit/s each way; yields the
    command prefix that runs a program in rank r's namespace, and rank r's interface."""
    _teardown()  # a previous run killed half-way
    try:
        for r in range(2):
            _ip("netns", "add", f"{PREFIX}{r}")
        _ip("link", "add", f"{PREFIX}v0", "type", "veth", "peer", "name", f"{PREFIX}v1")
        rate_bytes = mbit * 1e6 / 8
        burst = max(16 * 1024, int(rate_bytes / 100))  # 10 ms of traffic, as tbf wants >= rate/HZ
        for r in range(2):
            ns, dev = f"{PREFIX}{r}", f"{PREFIX}v{r}"
            _ip("link", "set", dev, "netns", ns)
            run = ["ip", "netns", "exec", ns]
            subprocess.run(
                [*run, "ip", "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", dev], check=True
            )
            subprocess.run([*run, "ip", "link", "set", dev, "up"], check=True)
            subprocess.run([*run, "ip", "link", "set", "lo", "up"], check=True)
            subprocess.run(
                [*run, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", str(burst), "latency", "200ms"],
                check=True,
            )  # fmt: skip
        yield lambda r: (["ip", "netns", "exec", f"{PREFIX}{r}"], f"{PREFIX}v{r}")
    finally:
        _teardown()


def run_throttled(module: str, fn_name: str, mbit: float, *args, timeout: float = 900):
    """``module.fn_name(*args)`` (JSON-able arguments and result) on 2 gloo ranks across a
    ``mbit`` Mbit/s link; returns the ranks' results."""
    with tempfile.TemporaryDirectory() as d, throttled_pair(mbit) as place:
        procs = []
        for r in range(2):
            prefix, dev = place(r)
            env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "PYTHONPATH": _root()}
            spec = json.dumps([module, fn_name, r, os.path.join(d, "rendezvous"), list(args)])
            out = os.path.join(d, f"rank{r}.json")
            cmd = [*prefix, sys.executable, "-m", "benchmarks.netns", spec, out]
            procs.append((subprocess.Popen(cmd, env=env, cwd=_root()), out))
        try:
            for p, _ in procs:
                p.wait(timeout=timeout)
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
        failed = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"throttled ranks {failed} failed (their stderr is above)")
        return [json.load(open(out)) for _, out in procs]


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_main() -> None:
    import importlib

    import torch
    import torch.distributed as dist

    module, fn_name, rank, init, args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        import tp_ext  # noqa: F401

        result = getattr(importlib.import_module(module), fn_name)(*args)
    finally:
        dist.destroy_process_group()
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _rank_main()
