"""Host memory of this process (Linux /proc), for the load reports: a sharded load must add only
about one shard to each rank's memory."""

from __future__ import annotations

from typing import Optional

__all__ = ["reset_peak_rss", "peak_rss_bytes", "current_rss_bytes", "import_readers"]


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (Linux ``clear_refs``); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status_bytes(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (Linux), in bytes; None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start (or the last reset), in bytes."""
    peak = _proc_status_bytes("VmHWM")
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


def current_rss_bytes() -> int:
    """This process's resident set size now, in bytes."""
    rss = _proc_status_bytes("VmRSS")
    return peak_rss_bytes() if rss is None else rss


def import_readers() -> None:
    """Import the libraries loading uses (safetensors, tqdm) now."""
    import safetensors  # noqa: F401
    import tqdm  # noqa: F401
