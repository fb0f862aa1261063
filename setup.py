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
"""
import os
import shutil
import subprocess
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit("dfss: building the Python package needs PyTorch installed in this interpreter; install "
             "torch first, then run 'pip install --no-build-isolation .' (an isolated build cannot see it)")

ROOT = os.path.dirname(os.path.abspath(__file__))


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
            "-DDFSS_WITH_TORCH=OFF", "-DDFSS_ENABLE_CUDA=OFF",
            # The core's std::string-carrying API must use the same libstdc++ ABI as torch.
            f"-DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI={abi}"])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.check_call(["cmake", "--build", build, "--target", "dfss", "--parallel", jobs])
        return os.path.join(build, "src", "libdfss.a")

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


ops = CppExtension(
    name="dfss._ops",
    sources=[os.path.join("src", "torch", n) for n in ("ops.cpp", "cpu.cpp", "meta.cpp", "cuda_unavailable.cpp")],
    include_dirs=[os.path.join(ROOT, "include")],
    # torch 1.13's cpp_extension defaults to C++14 and the dfss headers need C++17; torch 2.x picks
    # the standard its headers need (C++17, or C++20 for recent releases) by itself.
    extra_compile_args=(["-std=c++17"] if int(torch.__version__.split(".")[0]) < 2 else []) + ["-O2"],
    # The core parallelises with OpenMP and detects the CPU's SIMD targets with Google Highway
    # (libhwy, Debian libhwy-dev).
    extra_link_args=["-fopenmp", "-lhwy"],
)

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
