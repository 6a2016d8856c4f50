"""The torch adapter (csrc/torch) must compile against the installed torch.

CI has a CPU build of torch 2.13 and no GPU: it can compile every adapter
source to an object file (headers only; nothing to link against, since
libtorch_cuda is absent) using the CUDA runtime headers of $CUDA_HOME.  The
CPU wheel lacks one generated header, c10/cuda/impl/cuda_cmake_macros.h; the
test writes that one-line shim into a temporary include directory.  A broken
adapter fails this test.

Other torch versions: set CXLALLOC_TORCH_HEADER_TREES to ':'-separated torch
package directories (e.g. unpacked 2.11 and 2.14 wheels: /tmp/t211/torch) to
check them too.

With a CUDA build of torch (GPU or not), the adapter is also JIT-built,
linked, loaded and installed as torch's allocator in a subprocess.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from cxlalloc.pytorch import adapter_build

SHIM = "#define C10_CUDA_BUILD_SHARED_LIBS\n"  # what CUDA wheels of torch 2.11/2.14 ship in that header


def _torch_include():
    import torch

    return os.path.join(os.path.dirname(torch.__file__), "include")


def _needs(include_root):
    return [os.path.join(include_root, "c10", "cuda", "CUDACachingAllocator.h"),
            os.path.join(include_root, "torch", "csrc", "cuda", "CUDAPluggableAllocator.h")]


def _compile_all(tmp_path, torch_include_dirs=None, include_root=None):
    include_root = include_root or _torch_include()
    missing = [p for p in _needs(include_root) if not os.path.isfile(p)]
    if missing:
        pytest.skip(f"torch's c10/cuda headers are absent ({', '.join(missing)}): nothing to compile against")
    extra = []
    if not os.path.isfile(os.path.join(include_root, "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        shim = tmp_path / "shim"
        (shim / "c10" / "cuda" / "impl").mkdir(parents=True)
        (shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text(SHIM)
        extra.append(str(shim))
    extra += adapter_build.cuda_include_dirs()  # fails (does not skip) without CUDA headers

    def build(src):
        obj = tmp_path / (os.path.basename(src) + ".o")
        cmd = adapter_build.compile_command(src, extra, syntax_only=False, output=str(obj),
                                           torch_include_dirs=torch_include_dirs)
        r = subprocess.run(cmd, capture_output=True, text=True)
        return src, r.returncode, r.stderr, obj

    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(build, adapter_build.sources()))
    failures = [f"{os.path.basename(s)}:\n{err[-3000:]}" for s, rc, err, _ in results if rc != 0]
    assert not failures, "adapter does not compile:\n" + "\n".join(failures)
    for _, _, _, obj in results:
        assert obj.stat().st_size > 0
    return [os.path.basename(s) for s, *_ in results]


def test_adapter_sources_are_found():
    names = [os.path.basename(s) for s in adapter_build.sources()]
    assert names == ["allocator_alloc.cpp", "allocator_misc.cpp", "allocator_pools.cpp", "allocator_snapshot.cpp",
                     "allocator_stats.cpp", "capi_table.cpp", "history.cpp", "module.cpp"]
    assert adapter_build.source_root().endswith("csrc")


def test_adapter_compiles_against_installed_torch(tmp_path):
    built = _compile_all(tmp_path)
    assert len(built) == 8


@pytest.mark.parametrize("tree", [t for t in os.environ.get("CXLALLOC_TORCH_HEADER_TREES", "").split(":") if t])
def test_adapter_compiles_against_other_torch_trees(tmp_path, tree):
    inc = os.path.join(tree, "include")
    _compile_all(tmp_path, torch_include_dirs=[inc, os.path.join(inc, "torch", "csrc", "api", "include")],
                 include_root=inc)


def test_build_tag_and_cache_dir(monkeypatch, tmp_path):
    import torch

    tag = adapter_build.build_tag(torch)
    version = torch.__version__.replace("+", "_")
    git = (torch.version.git_version or "nogit")[:12]
    assert tag.startswith(f"torch-{version}-{git}-") and len(tag.rsplit("-", 1)[1]) == 12
    monkeypatch.setenv("CXLALLOC_CACHE_DIR", str(tmp_path))
    assert adapter_build.cache_root() == str(tmp_path)


def test_cuda_headers_from_cuda_home_or_pip(monkeypatch, tmp_path):
    home = tmp_path / "cuda"
    (home / "include" / "crt").mkdir(parents=True)
    (home / "include" / "cuda_runtime_api.h").write_text("")
    (home / "include" / "crt" / "host_defines.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert adapter_build.cuda_include_dirs(13) == [str(home / "include")]
    # a toolkit without crt/ (pip's nvidia-cuda-runtime alone) is not enough
    (home / "include" / "crt" / "host_defines.h").unlink()
    monkeypatch.setenv("CUDA_PATH", str(home))
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nvidia" else
                        real_find_spec(name, *a))
    if os.path.isfile("/usr/local/cuda/include/crt/host_defines.h"):
        assert adapter_build.cuda_include_dirs(13) == ["/usr/local/cuda/include"]
    else:
        with pytest.raises(adapter_build.AdapterBuildError, match="crt/host_defines.h"):
            adapter_build.cuda_include_dirs(13)


def test_cpu_torch_is_not_buildable_with_a_clear_reason():
    import torch

    if torch.version.cuda is not None:
        pytest.skip("torch is a CUDA build")
    with pytest.raises(adapter_build.AdapterBuildError) as e:
        adapter_build.check_buildable(torch)
    assert str(e.value) == (f"cxlalloc torch adapter: torch {torch.__version__} is a CPU-only build "
                            "(torch.version.cuda is None)")


INSTALL_CHECK = r"""
import torch, cxlalloc
from cxlalloc import _C
from cxlalloc.pytorch import adapter_build
m = adapter_build.load()
assert m.torch_version == torch.__version__.split("+")[0], (m.torch_version, torch.__version__)
assert m.current_allocator() == ("native", False), m.current_allocator()
assert not torch.cuda.is_initialized()
m.install(_C.__file__)
m.install(_C.__file__)  # idempotent
assert m.is_current()
assert torch.cuda.get_allocator_backend() == "cxlalloc"
assert m.current_allocator() == ("cxlalloc", False)
print("installed")
"""


def test_adapter_builds_links_and_installs_with_cuda_torch(tmp_path):
    import torch

    if torch.version.cuda is None:
        pytest.skip("torch is a CPU-only build: linking the adapter needs libtorch_cuda (a CUDA build of torch)")
    env = dict(os.environ, CXLALLOC_CACHE_DIR=os.environ.get("CXLALLOC_CACHE_DIR", str(tmp_path)))
    env.pop("CXLALLOC", None)
    r = subprocess.run([sys.executable, "-c", INSTALL_CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip() == "installed"


STATS_ON_SIM = r"""
import ctypes, torch
from cxlalloc import _C
from cxlalloc.pytorch import adapter_build
from cxlalloc.engine import configure, device_options, new_engine
from cxlalloc.config import make_config
MiB = 1 << 20
engine = new_engine(make_config(simulate=True))
opts = device_options(engine, 0, make_config(simulate=True, device_limit=64 * MiB, host_limit=256 * MiB,
                                                      device_headroom=0))
configure(engine, 0, opts)
_C.set_current_engine(engine)
m = adapter_build.load()
m.install(_C.__file__)
lib = ctypes.CDLL(_C.__file__)
lib.cxlalloc_malloc.restype = ctypes.c_void_p
lib.cxlalloc_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.cxlalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
p = lib.cxlalloc_malloc(3 * MiB, 0, None)          # device tier
q = lib.cxlalloc_malloc(100 * MiB, 0, None)        # beyond the 64 MiB device tier: host
ms = torch._C._cuda_memoryStats(0)                 # torch's binding -> adapter getDeviceStats -> C ABI
eng = engine.device(0).stats()["torch"]
flat_ok = all(ms[k.split(".")[0]][k.split(".")[1]][k.split(".")[2]] == v
              for k, v in eng.items() if k.count(".") == 2)
torch._C._cuda_beginAllocateToPool(0, (5, 0))      # every stream -> pool (5, 0)
r = lib.cxlalloc_malloc(2 * MiB, 0, None)
torch._C._cuda_endAllocateToPool(0, (5, 0))
live_exact = torch._C._cuda_checkPoolLiveAllocations(0, (5, 0), {r})
live_wrong = torch._C._cuda_checkPoolLiveAllocations(0, (5, 0), {p})
pools = torch._C._cuda_memoryStats(0).get("reserved_bytes_by_private_pools")
lib.cxlalloc_free(r, 2 * MiB, 0, None)
torch._C._cuda_releasePool(0, (5, 0))
lib.cxlalloc_free(q, 100 * MiB, 0, None)
lib.cxlalloc_free(p, 3 * MiB, 0, None)
torch._C._cuda_resetPeakMemoryStats(0)
after = torch._C._cuda_memoryStats(0)
print(repr((flat_ok, ms["allocated_bytes"]["all"]["current"], ms["allocation"]["all"]["current"],
            ms["max_split_size"], ms["num_ooms"], ms.get("num_oom_rejections", 0), live_exact, live_wrong,
            pools, after["allocated_bytes"]["all"]["peak"], torch.cuda.get_allocator_backend())))
"""


def test_adapter_stats_and_pools_through_torch_on_the_simulator(tmp_path):
    """With a CUDA build of torch but no GPU: torch's own bindings reach the
    adapter, which reads the (simulated) engine through the C ABI."""
    import torch

    if torch.version.cuda is None:
        pytest.skip("torch is a CPU-only build: the adapter cannot be linked here")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/pytorch/test_torch_gpu.py covers the real thing")
    env = dict(os.environ, CXLALLOC_CACHE_DIR=os.environ.get("CXLALLOC_CACHE_DIR", str(tmp_path)))
    env.pop("CXLALLOC", None)
    r = subprocess.run([sys.executable, "-c", STATS_ON_SIM], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    got = eval(r.stdout.strip().splitlines()[-1])
    minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    pools = {(5, 0): 20 << 20} if minor >= (2, 13) else None  # reserved_bytes_by_private_pools: 2.13+
    if pools is not None:
        assert {tuple(k) if not isinstance(k, tuple) else k: v["all"]["current"]
                for k, v in got[8].items()} == pools
    assert got[:8] == (True, 3 << 20, 1, -1, 0, 0, True, False)
    assert got[9:] == (0, "cxlalloc")
