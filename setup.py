"""Build tp_ext's C++/CUDA extension against the torch that is already installed.

    pip install --no-build-isolation -e .

CUDA sources are compiled when torch was built with CUDA and nvcc is found. Override with
TP_EXT_CUDA=1 (force CUDA, fail if impossible) or TP_EXT_CUDA=0 (CPU only).
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    forced = os.environ.get("TP_EXT_CUDA", "").strip()
    if forced == "1":
        return True
    if forced == "0":
        return False
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def _extension():
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cu_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    debug = os.environ.get("TP_EXT_DEBUG_BUILD", "0") == "1"
    cxx_flags = ["-O3" if not debug else "-O0", "-std=c++17", "-fdiagnostics-color=always"]
    cxx_flags += ["-Wno-deprecated-declarations"]
    if debug:
        cxx_flags += ["-g"]
    if _want_cuda():
        nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DTP_EXT_WITH_CUDA"]
        return cpp_extension.CUDAExtension(
            "tp_ext._C",
            cpp_sources + cu_sources,
            extra_compile_args={"cxx": cxx_flags + ["-DTP_EXT_WITH_CUDA"], "nvcc": nvcc_flags},
        )
    return cpp_extension.CppExtension(
        "tp_ext._C", cpp_sources, extra_compile_args={"cxx": cxx_flags}
    )


setup(
    name="tp_ext",
    packages=find_packages(include=["tp_ext", "tp_ext.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
