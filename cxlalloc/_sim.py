"""ctypes handle on the simulated CUDA driver (``cxlalloc/_simcuda*.so``).

The simulator is a plain shared library built from ``csrc/sim`` that exports
the CUDA driver entry points cxlalloc uses plus ``cxlsim_*`` controls
(``csrc/sim/cxlsim.h`` is the contract).  Tests use :class:`Sim` to configure
the simulated machine, inject faults, count calls and check for leaks; the
driver itself is reached the way cxlalloc reaches it, through
``cuGetProcAddress_v2``.

The library is loaded with ``RTLD_LOCAL``.  Loading the same path again (here
or from C++ via ``dlopen``) returns the same instance, so every :class:`Sim`
and cxlalloc's own driver loader share one simulated machine.

Units: sizes and addresses are bytes, times are microseconds.  Stream handles
are the integer values of ``CUstream`` (0 is the NULL/legacy stream).
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

__all__ = ["Sim", "library_path", "LIVE_FIELDS"]

# Field names of cxlsim_live_t, in declaration order (csrc/sim/cxlsim.h).
LIVE_FIELDS = (
    "phys_handles",
    "device_bytes",
    "host_numa_bytes",
    "reservations",
    "mappings",
    "managed_allocs",
    "device_allocs",
    "host_allocs",
    "registrations",
    "streams",
    "events",
    "context_refs",
)


class _Live(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in LIVE_FIELDS]


def library_path() -> str:
    """Return the absolute path of the built simulator, ``cxlalloc/_simcuda*.so``.

    Raises FileNotFoundError, naming the directory searched and how to build
    it, when the library is not there.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_simcuda*.so")))
    if not found:
        raise FileNotFoundError(
            f"the simulated CUDA driver is not built: no _simcuda*.so in {here}; "
            "build it with `pip install --no-build-isolation -e .` from the repository root"
        )
    return found[0]


_libs: dict[str, ctypes.CDLL] = {}
_libs_lock = threading.Lock()


def _load(path: str) -> ctypes.CDLL:
    path = os.path.abspath(path)
    with _libs_lock:
        lib = _libs.get(path)
        if lib is None:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
            _declare(lib)
            _libs[path] = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_u64, c_char_p, c_void_p, c_size_t = (
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
    )
    sigs = {
        "cxlsim_configure": (c_int, [c_char_p]),
        "cxlsim_last_error": (c_char_p, []),
        "cxlsim_fail": (c_int, [c_char_p, c_u64, c_int]),
        "cxlsim_clear_faults": (None, []),
        "cxlsim_call_count": (c_u64, [c_char_p]),
        "cxlsim_reset_counts": (None, []),
        "cxlsim_called_functions": (c_char_p, []),
        "cxlsim_function_names": (c_char_p, []),
        "cxlsim_live": (c_int, [ctypes.POINTER(_Live)]),
        "cxlsim_stream_sleep": (c_int, [c_void_p, c_u64]),
        "cxlsim_stream_write_u64": (c_int, [c_void_p, c_void_p, c_u64]),
        "cxlsim_begin_capture": (c_int, [c_void_p]),
        "cxlsim_end_capture": (c_int, [c_void_p]),
        "cxlsim_capture_violations": (c_u64, []),
        "cxlsim_async_faults": (c_u64, []),
        "cxlsim_last_async_fault": (c_char_p, []),
        "cxlsim_numa_bind": (c_int, [c_void_p, c_size_t, c_int]),
        "cxlsim_host_node_of": (c_int, [c_void_p]),
        "cxlsim_parse_size": (c_int, [c_char_p, ctypes.POINTER(c_u64)]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


class Sim:
    """Controls of the simulated CUDA driver.

    ``Sim()`` loads :func:`library_path`; ``Sim(path)`` a specific build.
    Instances are cheap: they share the loaded library and its state.
    """

    def __init__(self, path: str | None = None):
        self.path = os.path.abspath(path) if path else library_path()
        self.lib = _load(self.path)

    # ------------------------------------------------------------ helpers
    def _error(self) -> str:
        return (self.lib.cxlsim_last_error() or b"").decode()

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise ValueError(self._error())

    def function_names(self) -> list[str]:
        """Base names of every driver entry point the simulator counts and can fail."""
        return self.lib.cxlsim_function_names().decode().split(",")

    def _known(self, fn: str) -> None:
        if fn not in self.function_names():
            raise ValueError(f"unknown driver function {fn!r}; known: {', '.join(self.function_names())}")

    # ------------------------------------------------------------ machine
    def configure(self, spec: str = "") -> None:
        """Configure the simulated machine with a ``key=value,...`` spec (see cxlsim.h).

        Keys: devices, vram, granularity (sizes like ``64MiB``), numa
        (``0;1:0``), gpu_numa, reject_numa, relocate (``1:0``), attr.N, version.
        The empty spec restores the defaults.  Raises ValueError with the
        simulator's message for a bad spec, or while simulated resources are
        still live.
        """
        self._check(self.lib.cxlsim_configure(spec.encode()))

    def parse_size(self, text: str) -> int:
        """Parse a size the way specs do (``64MiB``, ``1.5GiB``, ``4096``) into bytes.

        Raises ValueError when it is not a size.
        """
        out = ctypes.c_uint64()
        if self.lib.cxlsim_parse_size(text.encode(), ctypes.byref(out)) != 0:
            raise ValueError(f"not a size: {text!r}")
        return out.value

    # ------------------------------------------------------------ faults and counters
    def fail(self, fn: str, nth: int = 1, error: int = 2) -> None:
        """Make the ``nth`` (1-based) next call of driver function ``fn`` fail with CUresult ``error``.

        ``fn`` is a base name (``"cuMemCreate"``) or ``"*"`` for any entry
        point; the default error is CUDA_ERROR_OUT_OF_MEMORY (2).  The failing
        call has no side effects.  Raises ValueError for an unknown function
        name, ``nth < 1`` or ``error == 0``.
        """
        if nth < 1:
            raise ValueError("nth must be >= 1 (1 = the next call)")
        self._check(self.lib.cxlsim_fail(fn.encode(), nth, error))

    def clear_faults(self) -> None:
        """Disarm every fault armed with :meth:`fail`."""
        self.lib.cxlsim_clear_faults()

    def call_count(self, fn: str) -> int:
        """Number of calls of driver function ``fn`` (base name) since the last reset.

        Failed and fault-injected calls count.  Raises ValueError for a name
        the simulator does not implement.
        """
        self._known(fn)
        return int(self.lib.cxlsim_call_count(fn.encode()))

    def reset_counts(self) -> None:
        """Zero every call counter."""
        self.lib.cxlsim_reset_counts()

    def called_functions(self) -> list[str]:
        """Sorted base names of the driver functions called at least once since the last reset."""
        text = self.lib.cxlsim_called_functions().decode()
        return text.split(",") if text else []

    def device_count(self) -> int:
        """GPUs of the simulated machine now (``devices=N``; 0 on a machine configured without GPUs).
        Calls the simulated ``cuInit(0)`` (creates nothing) and ``cuDeviceGetCount``."""
        lib = self.lib
        if lib.cuInit(ctypes.c_uint(0)) != 0:
            return 0
        n = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
            return 0
        return int(n.value)

    def live(self) -> dict[str, int]:
        """Live simulated resources, keyed by the cxlsim_live_t field names (:data:`LIVE_FIELDS`).

        ``device_bytes`` and ``host_numa_bytes`` are bytes; the others are counts.
        """
        out = _Live()
        if self.lib.cxlsim_live(ctypes.byref(out)) != 0:
            raise RuntimeError("cxlsim_live failed")
        return {name: int(getattr(out, name)) for name in LIVE_FIELDS}

    # ------------------------------------------------------------ streams
    def stream_sleep(self, stream: int, usec: int) -> None:
        """Enqueue a busy interval of ``usec`` microseconds on ``stream`` (stands in for a kernel).

        Raises ValueError when ``stream`` is not a live stream.
        """
        self._check(self.lib.cxlsim_stream_sleep(stream or None, usec))

    def stream_write_u64(self, stream: int, ptr: int, value: int) -> None:
        """Enqueue a "kernel" on ``stream`` that stores the uint64 ``value`` at address ``ptr``.

        It runs after the work queued before it.  If ``ptr`` is not device
        accessible when it runs, the context gets a sticky
        CUDA_ERROR_ILLEGAL_ADDRESS (see :meth:`async_faults`).  Raises
        ValueError when ``stream`` is not a live stream or ``ptr`` is 0.
        """
        self._check(self.lib.cxlsim_stream_write_u64(stream or None, ptr or None, value))

    def begin_capture(self, stream: int) -> None:
        """Start a (global-mode) graph capture on ``stream``, a cuStreamCreate stream.

        Captured work is recorded, not run.  Raises ValueError for the legacy
        stream, an unknown stream, or one already capturing.
        """
        self._check(self.lib.cxlsim_begin_capture(stream or None))

    def end_capture(self, stream: int) -> None:
        """End the capture begun on ``stream`` (and on the streams that joined it).

        Raises ValueError when ``stream`` did not begin a capture.
        """
        self._check(self.lib.cxlsim_end_capture(stream or None))

    def capture_violations(self) -> int:
        """Number of calls refused because of a capture since the last configure."""
        return int(self.lib.cxlsim_capture_violations())

    def async_faults(self) -> int:
        """Number of stream operations that faulted when they ran (since the last configure)."""
        return int(self.lib.cxlsim_async_faults())

    def last_async_fault(self) -> str:
        """Description of the most recent asynchronous fault, or ``""``."""
        return (self.lib.cxlsim_last_async_fault() or b"").decode()

    # ------------------------------------------------------------ NUMA
    def numa_bind(self, ptr: int, length: int, node: int) -> None:
        """Bind host pages ``[ptr, ptr+length)`` to simulated NUMA node ``node``.

        ``ptr`` must be page aligned and the range mapped plain host memory
        (not memory the simulated driver owns).  The pages are mbind()-ed to
        the real node backing ``node`` and the node is recorded for
        :meth:`host_node_of`.  Raises ValueError on a bad argument or a
        failing mbind.
        """
        self._check(self.lib.cxlsim_numa_bind(ptr, length, node))

    def host_node_of(self, ptr: int) -> int:
        """The simulated host NUMA node recorded for the page holding ``ptr``, or -1.

        -1 also for device memory and for memory the simulator knows nothing about.
        """
        return int(self.lib.cxlsim_host_node_of(ptr))
