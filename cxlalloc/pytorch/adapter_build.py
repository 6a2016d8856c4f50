"""Build cxlalloc's torch adapter (``csrc/torch``) against the installed torch.

Why at run time: the adapter subclasses torch's C++ ``CUDAPluggableAllocator``,
whose vtable layout changes between torch minor versions (2.11 -> 2.13 ->
2.14), so a binary built for one torch calls the wrong methods of another
(see docs/pytorch-integration.md, "Decision record").  It is therefore
compiled with ``torch.utils.cpp_extension.load`` on first use and cached per
torch build: the cache directory name carries ``torch.__version__``, torch's
git hash and a hash of the adapter's sources.

What a build needs:
  - a CUDA build of torch (``torch.version.cuda`` set; ``libtorch_cuda.so``);
  - a C++20 compiler and ninja (``torch.utils.cpp_extension`` uses both);
  - the CUDA runtime headers (``cuda_runtime_api.h`` and ``crt/host_defines.h``):
    from ``$CUDA_HOME/include`` (or ``$CUDA_PATH``, ``/usr/local/cuda``), else
    from pip's ``nvidia`` packages: ``nvidia-cuda-runtime`` + ``nvidia-cuda-crt``
    (CUDA 13, ``nvidia/cu13/include``) or ``nvidia-cuda-runtime-cu12`` +
    ``nvidia-cuda-nvcc-cu12`` (CUDA 12).
No CUDA toolkit (nvcc) and no GPU are needed to build.

Environment:
  ``CXLALLOC_CACHE_DIR``  where built adapters are kept (default
                          ``$XDG_CACHE_HOME/cxlalloc`` or ``~/.cache/cxlalloc``).
  ``CXLALLOC_BUILD_VERBOSE=1``  show the compiler's output.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import sys
import threading
from typing import List, Optional

_lock = threading.Lock()
_import_lock = threading.Lock()
_module = None

# The adapter's C++ standard: torch 2.14's headers need C++20
# (std::strong_ordering in c10/util/intrusive_ptr.h); 2.11 and 2.13 accept it.
CXX_STD = "-std=c++20"


class AdapterBuildError(RuntimeError):
    """The torch adapter cannot be built or loaded here (the message says why)."""


def source_root() -> str:
    """Directory holding ``torch/*.cpp`` and ``capi/c_api.h`` of the adapter.

    A source checkout (editable install) uses the repository's ``csrc``; an
    installed package uses the copy setup.py puts in ``cxlalloc/_adapter_src``.
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cxlalloc/
    for root in (os.path.join(os.path.dirname(package), "csrc"), os.path.join(package, "_adapter_src")):
        if os.path.isfile(os.path.join(root, "torch", "allocator.h")) and os.path.isfile(
                os.path.join(root, "capi", "c_api.h")):
            return root
    raise AdapterBuildError("cxlalloc torch adapter: sources not found (neither csrc/torch in a source checkout "
                            "nor cxlalloc/_adapter_src in the installed package); reinstall cxlalloc")


def sources() -> List[str]:
    """The adapter's .cpp files (absolute paths, sorted)."""
    return sorted(glob.glob(os.path.join(source_root(), "torch", "*.cpp")))


def _source_hash() -> str:
    root = source_root()
    files = sources() + sorted(glob.glob(os.path.join(root, "torch", "*.h"))) + [os.path.join(root, "capi", "c_api.h")]
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.basename(f).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:12]


def cache_root() -> str:
    """Root of cxlalloc's build cache (``CXLALLOC_CACHE_DIR`` overrides)."""
    env = os.environ.get("CXLALLOC_CACHE_DIR")
    if env:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "cxlalloc")


def build_tag(torch_module=None) -> str:
    """``torch-<version>-<git12>-<src12>``: the cache key of this torch + adapter."""
    torch = torch_module or __import__("torch")
    git = (getattr(torch.version, "git_version", None) or "nogit")[:12]
    version = torch.__version__.replace("+", "_")
    return f"torch-{version}-{git}-{_source_hash()}"


def _has_runtime_headers(inc: str) -> bool:
    return os.path.isfile(os.path.join(inc, "cuda_runtime_api.h")) and os.path.isfile(
        os.path.join(inc, "crt", "host_defines.h"))


def cuda_include_dirs(cuda_major: Optional[int] = None) -> List[str]:
    """Include directories that provide the CUDA runtime headers torch's
    c10/cuda headers include.

    Looks at ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda`` (``include``
    must hold ``cuda_runtime_api.h`` and ``crt/host_defines.h``), then at pip's
    nvidia packages for ``cuda_major`` (13: ``nvidia/cu13/include``; 12:
    ``nvidia/cuda_runtime/include`` + ``nvidia/cuda_nvcc/include``).

    Raises:
        AdapterBuildError: nothing usable was found (the message lists where
            it looked and what to install).
    """
    looked = []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if not home:
            continue
        inc = os.path.join(home, "include")
        looked.append(inc)
        if _has_runtime_headers(inc):
            return [inc]
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        candidates = []
        if cuda_major in (None, 13):
            candidates.append([os.path.join(root, "cu13", "include")])
        if cuda_major in (None, 12):
            candidates.append([os.path.join(root, "cuda_runtime", "include"), os.path.join(root, "cuda_nvcc", "include")])
        for dirs in candidates:
            looked.append(" + ".join(dirs))
            present = [d for d in dirs if os.path.isdir(d)]
            if any(os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) for d in present) and any(
                    os.path.isfile(os.path.join(d, "crt", "host_defines.h")) for d in present):
                return present
    hint = ("pip install nvidia-cuda-runtime nvidia-cuda-crt" if cuda_major != 12
            else "pip install nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12")
    raise AdapterBuildError(
        "cxlalloc torch adapter: CUDA runtime headers (cuda_runtime_api.h and crt/host_defines.h) not found; looked in "
        + "; ".join(looked or ["(nowhere)"]) + f". Set CUDA_HOME to a CUDA toolkit, or {hint}")


def _torch_cuda_major(torch) -> Optional[int]:
    v = getattr(torch.version, "cuda", None)
    try:
        return int(str(v).split(".")[0]) if v else None
    except ValueError:
        return None


def _ensure_ninja() -> None:
    """torch.utils.cpp_extension runs ``ninja`` from PATH.  A venv's python run
    without activating the venv does not have the venv's bin/ (where
    ``pip install ninja`` puts it) on PATH: add that directory to PATH then."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package

        dirs.insert(0, ninja.BIN_DIR)
    except Exception:
        pass
    for d in dirs:
        if os.path.isfile(os.path.join(d, "ninja")) and os.access(os.path.join(d, "ninja"), os.X_OK):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return
    raise AdapterBuildError("cxlalloc torch adapter: ninja is not installed (torch.utils.cpp_extension needs it); "
                            "pip install ninja")


def check_buildable(torch_module=None) -> None:
    """Raise :class:`AdapterBuildError` if this torch cannot host the adapter
    (CPU-only build, missing libtorch_cuda, no C++ compiler or ninja, missing
    CUDA headers)."""
    torch = torch_module or __import__("torch")
    if getattr(torch.version, "cuda", None) is None:
        raise AdapterBuildError(f"cxlalloc torch adapter: torch {torch.__version__} is a CPU-only build "
                                "(torch.version.cuda is None)")
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    if not glob.glob(os.path.join(lib, "libtorch_cuda.so*")):
        raise AdapterBuildError(f"cxlalloc torch adapter: {lib}/libtorch_cuda.so not found (torch {torch.__version__})")
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx.split()[0]):
        raise AdapterBuildError(f"cxlalloc torch adapter: no C++ compiler ('{cxx}' is not on PATH; set CXX)")
    _ensure_ninja()
    cuda_include_dirs(_torch_cuda_major(torch))


def _import_cpp_extension():
    """``torch.utils.cpp_extension``, imported without its start-up log line
    about CUDA_HOME (the adapter needs CUDA headers only, found by
    :func:`cuda_include_dirs`, never nvcc)."""
    import logging

    name = "torch.utils.cpp_extension"
    with _import_lock:  # a module half-imported by another thread has no attributes yet
        log = logging.getLogger(name)
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            from torch.utils import cpp_extension
        finally:
            log.setLevel(level)
    return cpp_extension


def load(verbose: Optional[bool] = None):
    """Build (first time, ~1 min) or load the cached adapter module.

    Returns the extension module (``install``, ``is_current``,
    ``current_allocator``, ``torch_version``).  Loading it does not initialise
    CUDA.

    Raises:
        AdapterBuildError: why it cannot be built here, with the compiler's
            first error lines when compilation failed.
    """
    global _module
    with _lock:
        if _module is not None:
            return _module
        import torch

        check_buildable(torch)
        cpp_extension = _import_cpp_extension()
        if verbose is None:
            verbose = os.environ.get("CXLALLOC_BUILD_VERBOSE") == "1"
        tag = build_tag(torch)
        build_dir = os.path.join(cache_root(), "torch-adapter", tag)
        os.makedirs(build_dir, exist_ok=True)
        name = "cxlalloc_torch_" + hashlib.sha256(tag.encode()).hexdigest()[:12]
        if not glob.glob(os.path.join(build_dir, name + "*.so")):
            sys.stderr.write(f"cxlalloc: building the torch adapter for torch {torch.__version__} "
                             f"(first use; cached in {build_dir})\n")
        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        try:
            _module = cpp_extension.load(
                name=name,
                sources=sources(),
                extra_cflags=["-O2", CXX_STD, "-Wno-unused-parameter"],
                extra_include_paths=cuda_include_dirs(_torch_cuda_major(torch)),
                # load() links c10/torch_cpu/torch/torch_python only; the
                # adapter subclasses libtorch_cuda's CUDAPluggableAllocator and
                # uses c10_cuda's allocator registry and streams.
                extra_ldflags=[f"-L{lib}", "-lc10_cuda", "-ltorch_cuda", "-ldl"],
                build_directory=build_dir,
                with_cuda=False,
                verbose=verbose,
            )
        except Exception as e:  # compiler/linker/loader failure: report its gist
            text = str(e).strip().splitlines()
            gist = " | ".join(line for line in text if "error" in line.lower())[:1500] or " | ".join(text[-5:])
            raise AdapterBuildError(f"cxlalloc torch adapter: build against torch {torch.__version__} failed in "
                                    f"{build_dir}: {gist or type(e).__name__} (set CXLALLOC_BUILD_VERBOSE=1 for "
                                    "the full compiler output)") from e
        return _module


def compile_command(source: str, include_dirs: List[str], syntax_only: bool = True, output: Optional[str] = None,
                    cxx: Optional[str] = None, torch_include_dirs: Optional[List[str]] = None) -> List[str]:
    """The compiler command that checks (or compiles to an object) one
    adapter source against torch's headers.

    Used by the CI test that type-checks the adapter on machines without a
    CUDA build of torch: ``include_dirs`` supplies the CUDA runtime headers
    and any shim for headers a CPU wheel lacks.  ``torch_include_dirs``
    defaults to the installed torch's (``torch.utils.cpp_extension.include_paths()``);
    pass another tree's to check the adapter against another torch version.
    Warnings in the adapter's own code are errors; torch's and CUDA's headers
    are system headers.
    """
    import sysconfig

    if torch_include_dirs is None:
        torch_include_dirs = _import_cpp_extension().include_paths()
    cmd = [cxx or os.environ.get("CXX", "c++"), CXX_STD, "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
           "-DTORCH_EXTENSION_NAME=cxlalloc_torch_check", "-DTORCH_API_INCLUDE_EXTENSION_H", "-fPIC"]
    for d in list(include_dirs) + list(torch_include_dirs) + [sysconfig.get_paths()["include"]]:
        cmd += ["-isystem", d]  # warnings from torch/CUDA headers are not ours
    cmd += ["-fsyntax-only"] if syntax_only else ["-c", "-o", output or os.devnull]
    cmd.append(source)
    return cmd
