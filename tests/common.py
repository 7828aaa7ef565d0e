"""Deterministic test data: every rank can build every rank's tensors, so a single-process
reference can be computed locally on each rank."""

import torch

WORLD_SIZES = [1, 2, 3, 4]


def full(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def assert_equal(actual, expected, what: str):
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def assert_close(actual, expected, what: str, rtol=1e-6, atol=1e-6):
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def local_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (each once; an FSDP2 DTensor: this rank's shard):
    what a rank holds of them, for the planner's memory tests."""
    seen = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
