"""The one list of op names in tp_ext.ops matches what the extension registers, every op has its
fake kernel, and nothing outside tp_ext/ops.py reaches torch.ops.tp_ext directly."""

import os
import re

import torch

from tp_ext import ops

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tp_ext")


def test_the_op_list_is_exactly_what_the_extension_registers():
    registered = {
        name.split("::", 1)[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("tp_ext::")
    }
    assert registered == set(ops.ALL_OPS)
    assert not set(ops.COLLECTIVE_OPS) & set(ops.KERNEL_OPS)


def test_every_op_has_a_fake_kernel():
    for name in ops.ALL_OPS:
        op = getattr(torch.ops.tp_ext, name).default
        assert (
            torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")
            or torch._library.simple_registry.singleton.find(op.name()).fake_impl.kernel is not None
        ), name


def test_only_ops_py_touches_torch_ops_tp_ext():
    offenders = []
    for root, _, files in os.walk(PACKAGE):
        for file in files:
            path = os.path.join(root, file)
            if not file.endswith(".py") or path == os.path.join(PACKAGE, "ops.py"):
                continue
            with open(path) as f:
                if re.search(r"torch\.ops\.tp_ext\.[A-Za-z_]", f.read()):
                    offenders.append(os.path.relpath(path, PACKAGE))
    assert offenders == [], (
        f"call the op through tp_ext.ops or tp_ext.distributed.comm: {offenders}"
    )
