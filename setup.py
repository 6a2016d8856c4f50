"""Build cxlalloc: one pybind11 extension (cxlalloc._C) and the simulated CUDA driver.

Neither links against CUDA or torch: the CUDA driver is loaded at run time with
dlopen (csrc/driver/), so the package builds and imports on machines with no GPU
and no driver.  CUDA's own ``cuda.h`` is used for the declarations when it is
found under ``$CUDA_HOME/include`` (default /usr/local/cuda); otherwise the
shipped ``csrc/driver/cuda_min.h`` stands in (tests check that the two agree).

Install (see README):  pip install 'pybind11>=2.12' 'setuptools>=64'
                       pip install -v --no-build-isolation .
(``--no-build-isolation`` builds against the environment's own pybind11 and
setuptools, so they are installed first; ``-v`` shows the build's
``cxlalloc build: [n/N] FILE`` lines, minutes on 2 cores.)
"""

import glob
import os
import shutil
import sys

try:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, naive_recompile
except ImportError as _e:  # pip --no-build-isolation: the build's requirements are the environment's own
    sys.exit(f"cxlalloc build: error: pybind11 is not installed in this environment ({_e}); the build needs "
             "pybind11>=2.12 and setuptools>=64 (pyproject.toml [build-system]): pip install 'pybind11>=2.12' "
             "'setuptools>=64', then pip install -v --no-build-isolation .")
from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py

# Compile the many small C++ files of _C in parallel (CI has 2 cores).  For
# development, CXLALLOC_INCREMENTAL=1 with `python setup.py build_ext
# --inplace` recompiles only .cpp files newer than their objects (touch a
# .cpp after editing a header it includes).
class ProgressParallelCompile(ParallelCompile):
    """pybind11's ParallelCompile that prints one line per compiled file.

    ``cxlalloc build: [12/47] csrc/alloc/segment.cpp`` goes to stderr as each
    file finishes, so a build run by pip (``pip install -v``, or
    scripts/bootstrap.sh, which shows the latest such line every 15 s) shows
    how far it is; the count is per extension (``_C``, then ``_simcuda``).
    """

    def function(self):
        parallel = super().function()

        def compile_with_progress(compiler, sources, *args, **kwargs):
            import sys
            import threading

            lock, done, total = threading.Lock(), [0], len(sources)
            single = compiler._compile

            def counted(obj, src, *rest):
                single(obj, src, *rest)
                with lock:
                    done[0] += 1
                    print(f"cxlalloc build: [{done[0]}/{total}] {os.path.relpath(src, HERE)}",
                          file=sys.stderr, flush=True)

            compiler._compile = counted  # this compiler object only, for this call
            try:
                return parallel(compiler, sources, *args, **kwargs)
            finally:
                del compiler._compile
                print(f"cxlalloc build: {done[0]} of {total} files compiled"
                      + (f", {total - done[0]} up to date" if done[0] < total else ""),
                      file=sys.stderr, flush=True)

        return compile_with_progress


HERE = os.path.dirname(os.path.abspath(__file__))

ProgressParallelCompile(
    "CXLALLOC_BUILD_JOBS",
    default=0,
    needs_recompile=naive_recompile if os.environ.get("CXLALLOC_INCREMENTAL") == "1" else None,
).install()

# `cxlalloc bench|demo`: the product's CLI finds these apps through this
# entry-point group (cxlalloc/cli.py), so no module of cxlalloc/ imports them.
# tests/app/conftest.py reads these two literals for checkouts whose installed
# metadata predates them.
APP_GROUP = "cxlalloc.apps"
APP_COMMANDS = {"bench": "cxlalloc_apps.bench.cli:main", "demo": "cxlalloc_apps.demo:main"}


def _cuda_include():
    """Return the CUDA include dir holding cuda.h, or None (then cuda_min.h is used)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    inc = os.path.join(home, "include")
    return inc if os.path.isfile(os.path.join(inc, "cuda.h")) else None


def _sources(*dirs):
    out = []
    for d in dirs:
        out += sorted(glob.glob(os.path.join("csrc", d, "*.cpp")))
    return out


CXXFLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing"]
include_dirs = ["csrc"]
macros = []
cuda_inc = _cuda_include()
if cuda_inc and os.environ.get("CXLALLOC_NO_CUDA_H") != "1":
    include_dirs.append(cuda_inc)
    macros.append(("CXL_HAVE_CUDA_H", "1"))

core = Pybind11Extension(
    "cxlalloc._C",
    _sources("common", "driver", "topology", "backend", "policy", "alloc", "kvstore", "capi", "python"),
    include_dirs=include_dirs,
    define_macros=macros,
    extra_compile_args=CXXFLAGS,
    libraries=["dl", "pthread"],
    cxx_std=17,
)

# The simulated driver is a plain shared library that exports the driver's C
# symbols (cuGetProcAddress_v2, ...); it is dlopen'ed RTLD_LOCAL by csrc/driver
# when simulate=True and never imported as a Python module.
sim = Extension(
    "cxlalloc._simcuda",
    _sources("sim"),
    include_dirs=include_dirs,
    define_macros=macros,
    extra_compile_args=CXXFLAGS + ["-std=c++17", "-fvisibility=hidden"],
    # Export only cu* and cxlsim_* (csrc/sim/exports.map), and fail the link,
    # not the dlopen, on a missing definition.
    extra_link_args=["-Wl,--version-script=" + os.path.join("csrc", "sim", "exports.map"), "-Wl,--no-undefined"],
    libraries=["dl", "pthread"],
    language="c++",
)


def _adapter_source_files():
    """(source, path inside the package) of the torch adapter's sources.

    The adapter (csrc/torch) is compiled at run time against whatever torch is
    installed (cxlalloc/pytorch/adapter_build.py), so an installed package carries its
    sources in cxlalloc/_adapter_src, laid out like csrc/.
    """
    files = sorted(glob.glob(os.path.join("csrc", "torch", "*.h")) + glob.glob(os.path.join("csrc", "torch", "*.cpp")))
    files.append(os.path.join("csrc", "capi", "c_api.h"))
    return [(f, os.path.join("cxlalloc", "_adapter_src", os.path.relpath(f, "csrc"))) for f in files]


class BuildPyWithStartupHook(build_py):
    """Also install ``cxlalloc-startup.pth`` at the top of site-packages, and
    the torch adapter's sources into the package.

    The .pth line imports ``cxlalloc.pytorch.startup`` only when the ``CXLALLOC``
    environment variable is set, so processes without it pay one
    ``os.environ`` lookup (see cxlalloc/pytorch/startup.py).

    Editable installs (``pip install -e .``, PEP 660): setuptools builds an
    editable wheel whose root is ``install_lib``; files written there (not to
    ``build_lib``, which is thrown away) land in site-packages, so the .pth
    goes there.  The adapter's sources are read from csrc/ in that case.
    """

    def _pth_target_dir(self):
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def run(self):
        super().run()
        src = os.path.join(HERE, "cxlalloc-startup.pth")
        if os.path.isfile(src):
            target = self._pth_target_dir()
            self.mkpath(target)
            shutil.copy(src, os.path.join(target, "cxlalloc-startup.pth"))
        if not getattr(self, "editable_mode", False):
            for f, rel in _adapter_source_files():
                dest = os.path.join(self.build_lib, rel)
                self.mkpath(os.path.dirname(dest))
                shutil.copy(os.path.join(HERE, f), dest)

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [os.path.join(self.build_lib, "cxlalloc-startup.pth")] + [
            os.path.join(self.build_lib, rel) for _, rel in _adapter_source_files()]


setup(
    name="cxlalloc",
    version="0.1.0",
    description="Tiered PyTorch CUDA allocator: VRAM first, then host/CXL NUMA memory, KV-cache aware",
    license="Apache-2.0",
    # Every package under cxlalloc/ (the product) and cxlalloc_apps/ (the benchmarks
    # and the main job, shipped beside it), so a new one is in a non-editable
    # install without a change here (tests/app/test_install.py).
    packages=find_packages(include=["cxlalloc", "cxlalloc.*", "cxlalloc_apps", "cxlalloc_apps.*"]),
    # the main job's default document (cxlalloc_apps/demo/app.py: DEFAULT_DOCUMENT)
    package_data={"cxlalloc": ["py.typed"], "cxlalloc_apps.demo": ["data/*.txt"],
                  "cxlalloc.plan": ["presets/*.json"]},  # cxlalloc plan's model configs
    ext_modules=[core] + ([sim] if sim.sources else []),
    cmdclass={"build_py": BuildPyWithStartupHook},
    python_requires=">=3.10",
    # xxhash: the per-block checksum and the weights digest (cxlalloc.kvstore.layout/keys), pinned: its digests
    # are stored, so another algorithm or version must never be picked up silently
    install_requires=["numpy", "xxhash==4.1.0"],
    extras_require={
        # transformers: the releases tested (5.25 renamed the serving manager cxlalloc serve patches and changed LFM2's
        # cache; scripts/bootstrap.sh pins 5.24.0)
        "hf": ["transformers>=5.0,<5.25", "accelerate", "gguf", "msgpack>=1.0"],
        # cxlalloc kv-server (msgpack: the protocol, also for its clients; redis: the Redis/Valkey tier;
        # prometheus_client: --metrics-port/--metrics-file; rich: --status tables)
        "kvserver": ["msgpack>=1.0", "redis>=5.0", "prometheus_client>=0.17", "rich"],
        # the LMCache remote-storage plugin (cxlalloc://, cxlalloc/kvstore/engines/lmcache_plugin.py) and the kv-server
        # docs/engines.md then starts, for an engine's environment (vLLM, SGLang, Dynamo): `pip install '.[lmcache]'`
        # from a clone; the project's own venv uses scripts/install_lmcache.sh instead
        "lmcache": ["lmcache==0.5.6", "msgpack>=1.0", "redis>=5.0", "prometheus_client>=0.17", "rich"],
        # hiredis: redis-py's C parser, as users run redis-py (the kvspeed lookup baseline; issue 33)
        "bench": ["matplotlib", "rich", "tqdm", "redis>=5.0", "hiredis>=3.0"],
        # cxlalloc serve: transformers' OpenAI-compatible server (transformers[serving] without accelerate's pin)
        "serve": ["transformers>=5.24,<5.25", "fastapi>=0.115", "uvicorn>=0.30", "openai>=1.98", "prometheus_client>=0.17"],
        # peft: the adapter-state tests (tests/hf/test_hf_reuse_state.py) run against the real package
        "test": ["pytest", "pytest-timeout", "msgpack>=1.0", "redis>=5.0", "prometheus_client>=0.17", "peft==0.21.2"],
        # building the torch adapter at run time (global mode)
        "torch": ["ninja"],
    },
    entry_points={"console_scripts": ["cxlalloc=cxlalloc.cli:main"],
                  APP_GROUP: [f"{name}={target}" for name, target in APP_COMMANDS.items()]},
    zip_safe=False,
)
