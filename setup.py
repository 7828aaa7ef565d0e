"""Build tp_ext's C++/CUDA extension against the torch that is already installed.

    pip install --no-build-isolation -e .

CUDA sources are compiled when torch was built with CUDA and nvcc is found. Override with
TP_EXT_CUDA=1 (force CUDA, fail if impossible) or TP_EXT_CUDA=0 (CPU only). CPU kernels are
built for the widest vector ISA the building machine has (TP_EXT_CPU_ARCH=auto | avx512 |
avx2 | none). With GCC the C++ files share one precompiled header of the torch headers
(TP_EXT_PCH=auto | 0 | 1; see BuildExtension below).
"""

import glob
import os
import subprocess
import sys

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


_CPU_ARCH_FLAGS = {
    "avx512": (
        ["avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"],
        [
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mfma",
            "-mf16c",
            "-DCPU_CAPABILITY=AVX512",
            "-DCPU_CAPABILITY_AVX512",
        ],
    ),
    "avx2": (
        ["avx2", "fma", "f16c"],
        ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    ),
}


def _cpu_vector_flags() -> list:
    """The widest vector ISA the building machine has (AVX-512, else AVX2), so at::vec uses its
    512/256-bit implementation and SLEEF's vector exp, as ATen's own kernels do; without these
    flags at::vec falls back to scalar loops (plus AVX-512 BF16 where the machine has it).
    TP_EXT_CPU_ARCH=none builds portable code;
    =avx2 or =avx512 forces one (to build on one machine and run on another)."""
    choice = os.environ.get("TP_EXT_CPU_ARCH", "auto").strip().lower()
    if choice not in ("auto", "none", *_CPU_ARCH_FLAGS):
        raise ValueError(f"TP_EXT_CPU_ARCH must be auto, none, avx2 or avx512, got {choice!r}")
    if choice == "none":
        return []
    if choice != "auto":
        return _CPU_ARCH_FLAGS[choice][1]
    try:
        with open("/proc/cpuinfo") as f:
            have = set(next((line.split() for line in f if line.startswith("flags")), []))
    except OSError:
        return []
    for name, (needed, flags) in _CPU_ARCH_FLAGS.items():
        if set(needed) <= have:
            # AVX-512 BF16 converts 32 floats to bf16 in one instruction (kernels' stores)
            extra = ["-mavx512bf16"] if name == "avx512" and "avx512_bf16" in have else []
            return flags + extra
    return []


def _openmp_flags() -> list:
    """-fopenmp when torch's CPU parallel backend is OpenMP. at::parallel_for is inlined into the
    extension and its `#pragma omp parallel` is compiled only under -fopenmp; without the flag
    every kernel runs on one thread. The libgomp this links against is the one torch has
    already loaded (same soname), so both share one thread pool."""
    import sys

    import torch

    if sys.platform != "linux" or not torch._C.has_openmp:
        return []
    return ["-fopenmp"]


def _extension():
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cu_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    debug = os.environ.get("TP_EXT_DEBUG_BUILD", "0") == "1"
    cxx_flags = ["-O3" if not debug else "-O0", "-std=c++17", "-fdiagnostics-color=always"]
    cxx_flags += ["-Wno-deprecated-declarations"] + _cpu_vector_flags()
    openmp = _openmp_flags()
    cxx_flags += openmp
    # Python's own CFLAGS carry -g; debug info in every TU of torch's templates is most of an
    # object's size (14 MB against 0.6 MB) and a third of its compile time, so release builds
    # drop it, as torch's own wheels do.
    cxx_flags += ["-g"] if debug else ["-g0"]
    if _want_cuda():
        nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DTP_EXT_WITH_CUDA"]
        return cpp_extension.CUDAExtension(
            "tp_ext._C",
            cpp_sources + cu_sources,
            extra_compile_args={"cxx": cxx_flags + ["-DTP_EXT_WITH_CUDA"], "nvcc": nvcc_flags},
            extra_link_args=openmp,
        )
    return cpp_extension.CppExtension(
        "tp_ext._C", cpp_sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=openmp
    )


def _want_pch(compiler: str) -> bool:
    """TP_EXT_PCH=auto (default) precompiles csrc/common/precompiled.h when the C++ compiler is
    GCC, whose ``-include x.h`` picks up ``x.h.gch``; =1 forces it, =0 builds without."""
    choice = os.environ.get("TP_EXT_PCH", "auto").strip().lower()
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"TP_EXT_PCH must be auto, 0 or 1, got {choice!r}")
    if choice != "auto":
        return choice == "1"
    return _is_gcc(compiler)


def _is_gcc(compiler: str) -> bool:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "Free Software Foundation" in version


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, plus one precompiled header for the C++ files.

    Most files spend two thirds of their compile time parsing the same torch headers (ATen,
    autograd, the dispatcher); torch's setup.py path has no precompiled-header option (only its
    JIT ``load_inline`` does), so this compiles ``csrc/common/precompiled.h`` once with exactly the
    flags of the C++ objects and force-includes it. GCC ignores a precompiled header whose flags
    differ (``-Winvalid-pch`` says so), so a mismatch costs time, never correctness. Rebuilt, with
    every object, only when its command line, its source or torch changes, so incremental builds
    stay incremental."""

    def build_extension(self, ext):
        cxx = cpp_extension.get_cxx_compiler()
        args = ext.extra_compile_args
        if isinstance(args, dict) and _want_pch(cxx):
            args["cxx"] = args["cxx"] + self._precompiled_header(cxx, ext, args["cxx"])
        self._link_the_shared_cxx_runtime(ext)
        super().build_extension(ext)
        self._check_cxx_runtime(self.get_ext_fullpath(ext.name))

    def _link_the_shared_cxx_runtime(self, ext) -> None:
        """Link libstdc++ as the shared library torch itself uses. A private, static copy (a
        ``-static-libstdc++`` in the interpreter's link flags, or a toolchain with only
        ``libstdc++.a`` to hand) has its own ``__cxa_throw`` and exception bookkeeping: every
        argument check that throws then crashes the process (SIGSEGV) instead of raising a
        Python error, as on the 2026-11-28 GPU machine."""
        if sys.platform != "linux" or not _is_gcc(cpp_extension.get_cxx_compiler()):
            return  # GCC on Linux only (-l: is a GNU ld spelling)
        linker = list(self.compiler.linker_so)
        if "-static-libstdc++" in linker:
            print("tp_ext: dropping -static-libstdc++ from the link command", flush=True)
            self.compiler.set_executable(
                "linker_so", [a for a in linker if a != "-static-libstdc++"]
            )
        if "-l:libstdc++.so.6" not in ext.extra_link_args:
            ext.extra_link_args = ["-l:libstdc++.so.6", *ext.extra_link_args]

    @staticmethod
    def _check_cxx_runtime(path: str) -> None:
        """Refuse an extension that carries its own C++ runtime (see above)."""
        import shutil

        nm = shutil.which("nm")
        if sys.platform != "linux" or nm is None or not os.path.exists(path):
            return
        symbols = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True)
        if any(line.endswith(" __cxa_throw") for line in symbols.stdout.splitlines()):
            raise RuntimeError(
                f"{path} defines __cxa_throw: libstdc++ was linked statically, so C++ errors "
                "would crash the process instead of raising. Link the shared libstdc++.so.6 "
                "(install the compiler's libstdc++ development package)."
            )

    def _precompiled_header(self, cxx: str, ext, cxx_flags: list) -> list:
        import shlex
        import shutil

        import torch

        source = os.path.join(ROOT, "csrc", "common", "precompiled.h")
        pch_dir = os.path.join(os.path.abspath(self.build_temp), "pch")
        header = os.path.join(pch_dir, "precompiled.h")
        gch = header + ".gch"
        macros = [f"-D{n}" if v is None else f"-D{n}={v}" for n, v in ext.define_macros]
        includes = [f"-I{d}" for d in list(ext.include_dirs) + self.compiler.include_dirs]
        # the order of the ninja rule: compiler flags, macros, includes, the extension's flags
        flags = self.compiler.compiler_so[1:] + macros + includes + cxx_flags
        command = [cxx, *flags, "-x", "c++-header", header, "-o", gch]
        with open(source) as f:
            text = f.read()
        stamp = "\n".join([shlex.join(command), torch.__version__, text])
        stamp_file = gch + ".stamp"
        os.makedirs(pch_dir, exist_ok=True)
        try:
            with open(stamp_file) as f:
                fresh = os.path.exists(gch) and f.read() == stamp
        except FileNotFoundError:
            fresh = False
        if not fresh:
            # GCC's dependency lists leave out what came from the precompiled header, so ninja
            # would not see that torch or this header changed: the objects are rebuilt here
            for obj in glob.glob(os.path.join(self.build_temp, "**", "*.o"), recursive=True):
                os.remove(obj)
            shutil.copyfile(source, header)
            print(f"precompiling {os.path.relpath(source, ROOT)}", flush=True)
            subprocess.run(command, check=True)
            with open(stamp_file, "w") as f:
                f.write(stamp)
        return ["-include", header, "-Winvalid-pch"]


setup(
    name="tp_ext",
    packages=find_packages(include=["tp_ext", "tp_ext.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
