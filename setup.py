"""pip install --no-build-isolation .   (PyTorch must be installed first)

Builds the Python package `dfss` (python/dfss) and its operator library dfss/_ops*.so:
1. the dfss core (the C++ library, static, position-independent) with CMake, exactly as the C++
   build compiles it (its per-file ISA flags, OpenMP, generated headers), or reuses a prebuilt one
   named by DFSS_CORE_LIBRARY (path to libdfss.a; the CTest suite passes its own), plus the
   libraries it needs in DFSS_CORE_LINK_LIBS (space separated; e.g. libcudart for a core built
   with the CUDA backend);
2. src/torch/*.cpp (the torch.ops.dfss operator) with torch.utils.cpp_extension against the torch
   of the running interpreter, so the flags and ABI match that torch whatever its version.
--no-build-isolation: the build must see the installed torch (an isolated build would fetch another).

CUDA (DFSS_CUDA=AUTO, the default; ON; OFF): the operator gets its CUDA kernels (src/torch/cuda.cpp:
the forward through dfss's CUDA backend, on the caller's current stream) when
  * torch was built with CUDA (torch.version.cuda; a GPU is not needed to build: the CUDA wheel has
    the headers and libraries the kernel file uses),
  * the CUDA toolkit's headers are found (torch.utils.cpp_extension.CUDA_HOME, from CUDA_HOME or
    nvcc on PATH or /usr/local/cuda), and
  * the dfss core has the CUDA backend: a prebuilt DFSS_CORE_LIBRARY has it when it defines
    dfss::cuda::attention_forward (CMake built it with nvcc); a core built here has it when nvcc is at
    CUDA_HOME/bin, for DFSS_CUDA_ARCHITECTURES (default "80;90", the sparse tensor cores' sm_80+).
Otherwise src/torch/cuda_unavailable.cpp: CUDA tensors get a clear error. ON makes a missing piece a
build failure, OFF never compiles the CUDA kernels. Only .cpp files are compiled here (the CUDA
kernels are in the core), so the CUDA build of the extension costs no nvcc time when the core is
prebuilt. dfss/_build_info.py records the choice and its reason (dfss._build_info.cuda, .cuda_reason).
"""
import os
import shutil
import subprocess
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    import torch.utils.cpp_extension as cpp_extension
except ImportError:
    sys.exit("dfss: building the Python package needs PyTorch installed in this interpreter; install "
             "torch first, then run 'pip install --no-build-isolation .' (an isolated build cannot see it)")

ROOT = os.path.dirname(os.path.abspath(__file__))


def _core_has_cuda(path):
    """Whether the prebuilt core @p path holds the CUDA backend: its entry point
    dfss::cuda::attention_forward (mangled below) is named in the archive (symbol index and the
    objects' symbol tables) exactly when CMake compiled src/cuda into it."""
    with open(path, "rb") as f:
        return b"_ZN4dfss4cuda17attention_forward" in f.read()


def _cuda_choice():
    """(build the CUDA kernels?, why), following DFSS_CUDA and the module docstring's rules."""
    mode = os.environ.get("DFSS_CUDA", "AUTO").upper()
    if mode not in ("AUTO", "ON", "OFF"):
        sys.exit(f"dfss: DFSS_CUDA: expected AUTO, ON or OFF, got {os.environ['DFSS_CUDA']!r}")
    if mode == "OFF":
        return False, "DFSS_CUDA=OFF"
    home = cpp_extension.CUDA_HOME
    prebuilt = os.environ.get("DFSS_CORE_LIBRARY")
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} was built without CUDA"
    elif home is None or not os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")):
        why = "the CUDA toolkit's headers were not found (set CUDA_HOME, or put nvcc on PATH)"
    elif prebuilt and os.path.isfile(prebuilt) and not _core_has_cuda(prebuilt):
        why = f"the prebuilt core {prebuilt} has no CUDA backend (configure it with nvcc found)"
    elif not prebuilt and not os.path.isfile(os.path.join(home, "bin", "nvcc")):
        why = f"no nvcc at {home}/bin to compile the core's CUDA backend"
    else:
        core = (f"prebuilt core {prebuilt} with the CUDA backend" if prebuilt
                else f"the core built here with the CUDA backend (nvcc at {home}/bin)")
        return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA headers at {home}, {core}"
    if mode == "ON":
        sys.exit(f"dfss: DFSS_CUDA=ON but {why}")
    return False, why


WITH_CUDA, CUDA_REASON = _cuda_choice()


class build_ext(BuildExtension):
    """Builds (or takes) the static dfss core first, links it into the extension, and records the
    torch version the extension was compiled against."""

    def _core_library(self):
        prebuilt = os.environ.get("DFSS_CORE_LIBRARY")
        if prebuilt:
            if not os.path.isfile(prebuilt):
                sys.exit(f"dfss: DFSS_CORE_LIBRARY={prebuilt} is not a file")
            return prebuilt
        build = os.path.join(os.path.abspath(self.build_temp), "dfss-core")
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        if shutil.which("cmake") is None:
            sys.exit("dfss: building the package needs cmake (>= 3.25) on PATH for the C++ core "
                     "(Debian: apt-get install cmake), or DFSS_CORE_LIBRARY naming a built libdfss.a")
        subprocess.check_call([
            "cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
            "-DDFSS_BUILD_TESTS=OFF", "-DDFSS_BUILD_TOOLS=OFF", "-DDFSS_BUILD_BENCH=OFF",
            "-DDFSS_WITH_TORCH=OFF", "-DDFSS_BUILD_CUDA_BENCH=OFF",
            # The core's std::string-carrying API must use the same libstdc++ ABI as torch.
            f"-DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI={abi}"] + self._core_cuda_args(abi))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.check_call(["cmake", "--build", build, "--target", "dfss", "--parallel", jobs])
        return os.path.join(build, "src", "libdfss.a")

    @staticmethod
    def _core_cuda_args(abi):
        if not WITH_CUDA:
            return ["-DDFSS_ENABLE_CUDA=OFF"]
        home = cpp_extension.CUDA_HOME
        return ["-DDFSS_ENABLE_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={os.path.join(home, 'bin', 'nvcc')}",
                f"-DDFSS_CUDA_ARCHITECTURES={os.environ.get('DFSS_CUDA_ARCHITECTURES', '80;90')}",
                # The CUDA backend's host code passes std::string too (its reasons).
                f"-DCMAKE_CUDA_FLAGS=-D_GLIBCXX_USE_CXX11_ABI={abi}"]

    def run(self):
        core = self._core_library()
        extra = os.environ.get("DFSS_CORE_LINK_LIBS", "").split() if os.environ.get("DFSS_CORE_LIBRARY") else []
        for ext in self.extensions:
            ext.extra_objects = [core] + extra
        super().run()
        info = os.path.join(self.build_lib, "dfss", "_build_info.py")
        os.makedirs(os.path.dirname(info), exist_ok=True)
        with open(info, "w") as f:
            f.write(f"torch_version = {torch.__version__!r}\n")
            f.write(f"cuda = {WITH_CUDA!r}\n")
            f.write(f"cuda_reason = {CUDA_REASON!r}\n")


# CUDAExtension only adds CUDA's include path and the CUDA libraries of torch (c10_cuda, torch_cuda)
# and the runtime (cudart): the sources stay .cpp files, compiled by the C++ compiler.
ops = (CUDAExtension if WITH_CUDA else CppExtension)(
    name="dfss._ops",
    sources=[os.path.join("src", "torch", n)
             for n in ("ops.cpp", "cpu.cpp", "meta.cpp", "cuda.cpp" if WITH_CUDA else "cuda_unavailable.cpp")],
    include_dirs=[os.path.join(ROOT, "include")],
    # torch 1.13's cpp_extension defaults to C++14 and the dfss headers need C++17; torch 2.x picks
    # the standard its headers need (C++17, or C++20 for recent releases) by itself.
    extra_compile_args=(["-std=c++17"] if int(torch.__version__.split(".")[0]) < 2 else []) + ["-O2"],
    # The core parallelises with OpenMP and detects the CPU's SIMD targets with Google Highway
    # (libhwy, Debian libhwy-dev).
    extra_link_args=["-fopenmp", "-lhwy"],
)
print(f"dfss: CUDA kernels of the operator: {'yes' if WITH_CUDA else 'no'} ({CUDA_REASON})", file=sys.stderr)

BUILD_BASE = os.environ.get("DFSS_PYTHON_BUILD_DIR", "build-python")
# The egg-info metadata goes there too instead of python/dfss.egg-info, so that two builds from the
# same source tree (CTest python_package and python_transformers, run in parallel) write nothing
# in common.
os.makedirs(BUILD_BASE, exist_ok=True)

setup(
    package_dir={"": "python"},
    packages=["dfss"],
    ext_modules=[ops],
    cmdclass={"build_ext": build_ext},
    # Out of the source tree's way: `build/` is the CMake default preset's directory.
    options={"build": {"build_base": BUILD_BASE}, "egg_info": {"egg_base": BUILD_BASE}},
)
