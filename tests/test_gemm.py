"""tp_ext's GEMMs (csrc/common/gemm.h and the op tp_ext::linear): float32 CPU GEMMs through
oneDNN, every other case through aten, the setting that switches them, and the results against
a float64 reference."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from tp_ext import ops

from .common import assert_close, full


@pytest.fixture
def gemm():
    """Sets the CPU GEMM for one test and puts the previous one back."""
    previous = ops.cpu_gemm()
    yield ops.set_cpu_gemm
    ops.set_cpu_gemm(previous)


def _grads(fn, *args):
    """fn's output and its inputs' gradients for a fixed upstream gradient."""
    leaves = [None if a is None else a.detach().clone().requires_grad_() for a in args]
    out = fn(*leaves)
    out.backward(full(out.shape, 99, out.dtype))
    return [out.detach()] + [None if a is None else a.grad for a in leaves]


def _kernels(fn) -> set[str]:
    """The names of the GEMM kernels fn runs (as torch.profiler records them)."""
    with profile() as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    return {n for n in names if n in ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")}


@pytest.mark.parametrize("name", ["onednn", "aten"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 24), (2, 5, 24), (0, 24)])
def test_linear_and_its_gradients_equal_float64(gemm, name, bias, shape):
    gemm(name)
    x, w = full(shape, 1), full((11, 24), 2)
    b = full((11,), 3) if bias else None
    mine = _grads(ops.linear, x, w, b)
    ref = _grads(F.linear, x.double(), w.double(), None if b is None else b.double())
    for what, got, want in zip(("y", "grad x", "grad weight", "grad bias"), mine, ref):
        if want is not None:
            assert got.dtype == torch.float32
            assert_close(got, want.float(), what, rtol=1e-5, atol=1e-5)


def test_aten_setting_is_f_linear_bitwise(gemm):
    gemm("aten")
    x, w, b = full((2, 5, 24), 1), full((11, 24), 2), full((11,), 3)
    for got, want in zip(_grads(ops.linear, x, w, b), _grads(F.linear, x, w, b)):
        assert torch.equal(got, want)


def test_float32_cpu_gemms_run_in_onednn_unless_set_to_aten(gemm):
    if not torch.backends.mkldnn.is_available():
        pytest.fail("this torch has no oneDNN: the default CPU GEMM cannot be tested here")
    x = full((6, 16), 1).requires_grad_()
    w = full((8, 16), 2).requires_grad_()

    def step():
        ops.linear(x, w).sum().backward()

    gemm("onednn")
    assert ops.cpu_gemm() == "onednn"
    assert _kernels(lambda: ops.linear(x.detach(), w.detach())) == {"mkldnn::_linear_pointwise"}
    # the input gradient too; the weight gradient's grad^T operand is strided (oneDNN's op would
    # copy it), so that GEMM stays aten's
    assert _kernels(step) == {"mkldnn::_linear_pointwise", "aten::mm"}
    gemm("aten")
    assert "mkldnn::_linear_pointwise" not in _kernels(step)
    # float64 has no oneDNN GEMM: aten's, whatever the setting
    gemm("onednn")
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    assert "mkldnn::_linear_pointwise" not in _kernels(lambda: ops.linear(xd, wd).sum().backward())


def test_non_contiguous_operands(gemm):
    gemm("onednn")
    x = full((24, 7), 1).t()  # [7, 24], transposed
    w = full((24, 11), 2).t()  # [11, 24], transposed
    want = F.linear(x.double(), w.double()).float()
    assert_close(ops.linear(x, w), want, "y", rtol=1e-5, atol=1e-5)


def test_autocast_runs_in_its_dtype(gemm):
    gemm("onednn")
    x, w = full((4, 16), 1), full((8, 16), 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = ops.linear(x, w), F.linear(x, w)
    assert got.dtype == want.dtype == torch.bfloat16
    assert_close(got.float(), want.float(), "y under autocast", rtol=1e-2, atol=1e-2)


def test_meta_tensors_take_the_shape():
    x = torch.empty(3, 5, 16, device="meta")
    w = torch.empty(8, 16, device="meta")
    assert ops.linear(x, w).shape == (3, 5, 8)


def test_compiled_and_exported(gemm):
    gemm("onednn")
    x, w, b = full((2, 5, 24), 1), full((11, 24), 2), full((11,), 3)

    def fn(x, w, b):
        return torch.relu(ops.linear(x, w, b))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert_close(compiled(x, w, b), fn(x, w, b), "compiled", rtol=0, atol=0)

    class Layer(torch.nn.Module):
        def forward(self, x, w, b):
            return fn(x, w, b)

    exported = torch.export.export(Layer(), (x, w, b))
    assert_close(exported.module()(x, w, b), fn(x, w, b), "exported", rtol=0, atol=0)


def test_bad_arguments_are_named(gemm):
    with pytest.raises(ValueError, match=r"name='mkl' is not a CPU GEMM; use 'onednn'"):
        gemm("mkl")
    with pytest.raises(ValueError, match=r"tp_ext.linear: x has shape \[3, 5\] but weight"):
        ops.linear(full((3, 5), 1), full((4, 6), 2))
    with pytest.raises(ValueError, match=r"bias has shape \[3\]; it must be \[4\]"):
        ops.linear(full((3, 6), 1), full((4, 6), 2), full((3,), 3))
    with pytest.raises(ValueError, match=r"bias has dtype Double but weight has Float"):
        torch.ops.tp_ext.linear(full((3, 6), 1), full((4, 6), 2), full((4,), 3).double())
    with pytest.raises(RuntimeError, match=r"x.shape\[-1\] must equal weight.shape\[1\]"):
        ops.linear(torch.empty(3, 5, device="meta"), torch.empty(4, 6, device="meta"))


def test_a_bad_environment_value_is_named():
    code = (
        "import torch, tp_ext\n"
        "from tp_ext import ops\n"
        "try:\n"
        "    ops.linear(torch.ones(2, 3), torch.ones(4, 3))\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, TP_EXT_CPU_GEMM="fast")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "TP_EXT_CPU_GEMM='fast' is not a CPU GEMM; use 'onednn'" in out.stdout, out.stdout
    env["TP_EXT_CPU_GEMM"] = "aten"
    out = subprocess.run(
        [sys.executable, "-c", "from tp_ext import ops; print(ops.cpu_gemm())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "aten"


@pytest.mark.parametrize("name", ["onednn", "aten"])
def test_strided_and_expanded_biases(gemm, name):
    gemm(name)
    x, w = full((6, 8), 1), full((5, 8), 2)
    for b in (torch.arange(10.0)[::2], torch.tensor([1.5]).expand(5)):
        want = F.linear(x.double(), w.double(), b.double()).float()
        assert_close(ops.linear(x, w, b), want, f"bias strides {b.stride()}", rtol=1e-5, atol=1e-5)


def test_second_derivatives_equal_f_linear(gemm):
    gemm("onednn")
    x, w, b = full((4, 6), 1).double(), full((3, 6), 2).double(), full((3,), 3).double()

    def hessian(fn):
        return torch.autograd.functional.hessian(lambda w: fn(x, w, b).square().sum(), w)

    assert_close(hessian(ops.linear), hessian(F.linear), "Hessian", rtol=1e-10, atol=1e-10)

    def penalty(fn):  # a gradient penalty: d/dw |d loss / dx|^2
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        (gx,) = torch.autograd.grad(fn(xi, wi, b).square().sum(), xi, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), wi)[0]

    assert_close(penalty(ops.linear), penalty(F.linear), "penalty", rtol=1e-10, atol=1e-10)


def test_a_frozen_layer_saves_no_activation(gemm):
    gemm("onednn")
    x = full((64, 32), 1).requires_grad_()
    w = full((16, 32), 2)  # frozen
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        y = ops.linear(x, w)
    assert torch.Size([64, 32]) not in saved, saved
    y.sum().backward()
    assert_close(x.grad, w.sum(0).expand(64, 32), "grad x", rtol=1e-5, atol=1e-5)


def test_autocast_leaves_float64_alone(gemm):
    x, w = full((4, 16), 1).double(), full((8, 16), 2).double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops.linear(x, w).dtype == F.linear(x, w).dtype == torch.float64


def test_mkldnn_switched_off_by_torch_flags(gemm):
    gemm("onednn")
    x, w = full((6, 16), 1), full((8, 16), 2)
    with torch.backends.mkldnn.flags(enabled=False):
        assert "mkldnn::_linear_pointwise" not in _kernels(lambda: ops.linear(x, w))
