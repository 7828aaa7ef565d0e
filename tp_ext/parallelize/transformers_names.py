"""Keyword names of transformers' model forwards that differ between the transformers versions
tp_ext runs with, kept in one place.

transformers 5.24 renamed the KV-cache argument ``past_key_values`` to ``cache`` (the old name
warns from 5.24 and goes in 5.40); before 5.24 only ``past_key_values`` exists. tp_ext passes
the name the installed transformers takes, and accepts either from its callers.
"""

from __future__ import annotations

import functools

__all__ = ["cache_argument", "take_cache"]

_OLD = "past_key_values"


@functools.cache
def cache_argument() -> str:
    """The KV-cache keyword of the installed transformers' forwards."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else _OLD


def take_cache(call: dict):
    """The cache a forward's keyword arguments ``call`` carry, under either name; the call is
    left holding it (if any) under :func:`cache_argument` only."""
    name = cache_argument()
    given = call.pop(_OLD, None) if name != _OLD else None
    if call.get(name) is None and given is not None:
        call[name] = given
    return call.get(name)
