"""``cxlalloc.Allocator``: the tiered allocator of one GPU, used directly.

Global mode (``cxlalloc.enable()``) makes the same engine torch's allocator;
this class is for direct use, tests, capacity planning, and (with
``simulate=True``) machines without a GPU.
"""

from __future__ import annotations

import math
import operator
import warnings
from typing import List, Optional, Sequence

from cxlalloc.engine import configure, device_options, extent_chunk_message, new_engine
from cxlalloc.config import TAGS, make_config, parse_size

_DL_CPU = 1   # DLPack kDLCPU
_DL_CUDA = 2  # DLPack kDLCUDA


def _check_tag(tag: str) -> str:
    if tag not in TAGS:
        raise ValueError(f"cxlalloc: tag {tag!r} is not an allocation class; allowed: {', '.join(TAGS)}")
    return tag


def _nbytes(n, what: str = "nbytes") -> int:
    """A byte count from the caller: an int in [0, 2**64)."""
    if isinstance(n, bool) or not isinstance(n, int):
        try:
            import numpy as _np

            if isinstance(n, _np.integer):
                n = int(n)
        except ImportError:
            pass
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"cxlalloc: {what} must be an int (bytes), not {type(n).__name__}")
    if not 0 <= n < 1 << 64:
        raise ValueError(f"cxlalloc: {what} must be between 0 and 2**64-1 bytes, not {n}")
    return n


def _show(x) -> str:
    """``x`` for an error message: an int as it is, an array or tensor by its
    type, shape and dtype (never its values), anything else by a short repr."""
    if isinstance(x, int):
        return repr(x)
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {type(x).__module__.split('.')[0]}.{type(x).__name__} of shape {tuple(shape)} and dtype {dtype}"
    r = repr(x)
    return r if len(r) <= 60 else f"a {type(x).__name__} ({r[:40]}...)"


def _ptr(p) -> int:
    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < 1 << 64:
        hint = " (for a tensor: its .data_ptr())" if hasattr(p, "data_ptr") else ""
        raise ValueError(f"cxlalloc: {_show(p)} is not a pointer (an int address returned by malloc){hint}")
    return p


def _stream(s) -> int:
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 1 << 64:
        raise ValueError(f"cxlalloc: stream {_show(s)} is not a stream handle (an int CUstream, e.g. "
                         "torch.cuda.current_stream().cuda_stream, or 0 for the default stream)")
    return s


def _check_tier(tier: str) -> str:
    if tier not in ("device", "host"):
        raise ValueError(f"cxlalloc: tier {tier!r} is not a tier; allowed: device, host")
    return tier


# Keys of Allocator.stats() that name something (a device, a node): listed per GPU in totals, not summed.
_NAME_KEYS = ("device", "numa_node", "backend", "method")


def sum_stats(per_gpu: List[dict]) -> dict:
    """Totals of several :meth:`cxlalloc.Allocator.stats` dicts: numbers summed
    (peaks: the sum of each GPU's peak), names (``device``, ``numa_node``,
    ``backend``, ``method``) listed per GPU, in order."""
    out = {}
    for key in per_gpu[0]:
        vals = [d.get(key) for d in per_gpu]
        if all(isinstance(v, dict) for v in vals):
            out[key] = sum_stats(vals)
        elif key in _NAME_KEYS:
            out[key] = vals
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = sum(vals)
        else:
            out[key] = vals[0] if all(v == vals[0] for v in vals) else vals
    return out


class Allocator:
    """A tiered caching allocator for one GPU: VRAM first, then host memory
    on one NUMA node (DRAM or a CXL expander), mapped for the GPU.

    Args:
        device_limit: VRAM the allocator may hold: bytes, a size string
            (``"512MiB"``, ``"8GiB"``) or a fraction of VRAM (``0.5``,
            ``"50%"``); default: free VRAM at start minus 256 MiB.
        host_limit: bytes on the host tier (size string accepted); default
            80% of the host node's free memory; 0 disables spilling.
        numa_node: host NUMA node for the host tier, or ``"auto"`` (a
            CPU-less/CXL node near the GPU if any, else the GPU's nearest).
        backend: host-tier backend: ``"auto"``, ``"host-vmm"``,
            ``"managed"``, ``"pinned"`` (see README "Backends").
        simulate: run on the simulated CUDA driver shipped with the package
            (no GPU needed; never a substitute for verification on a GPU).
        device: CUDA device ordinal (default 0).
        **options: the other options of :mod:`cxlalloc.config`
            (``kv_device_limit``, ``device_headroom``, ``migration_rate``,
            ``promote_after``, ``extent_chunk``, ``strict_placement``,
            ``sim_vram``, ``libcuda``).

    Raises:
        ValueError: a bad option (the message names it and its allowed values).
        cxlalloc.CudaUnavailableError: no CUDA driver (and simulate=False).
        cxlalloc.CudaUnavailableError: the requested backend cannot work here
            (the message lists each backend's support and why).
    """

    # How out-of-memory messages tell the user to raise a limit: where this
    # Allocator is made (cxlalloc.hf.wrap passes its own call).
    MADE_BY = 'cxlalloc.Allocator(..., host_limit="64GiB")'

    def __init__(self, device_limit=None, host_limit=None, numa_node="auto", backend="auto",
                 simulate: bool = False, device: int = 0, *, _made_by: Optional[str] = None, **options):
        self.config = make_config(device_limit=device_limit, host_limit=host_limit, numa_node=numa_node,
                                  backend=backend, simulate=simulate, device=device, **options)
        self._engine = new_engine(self.config)
        self.device = self.config.device or 0
        if self.device >= self._engine.device_count:
            raise ValueError(f"cxlalloc option 'device': {self.device} is not a CUDA device ordinal here "
                             f"(0..{self._engine.device_count - 1})")
        opts = device_options(self._engine, self.device, self.config, made_by=_made_by or self.MADE_BY)
        self.node_reason = opts["node_reason"]
        configure(self._engine, self.device, opts)
        self._dev = self._engine.device(self.device)
        self.simulated = bool(self.config.simulate)
        rounded = extent_chunk_message(self.config.extent_chunk, self._dev.info())
        if rounded:
            warnings.warn(rounded, UserWarning, stacklevel=2)

    @classmethod
    def from_engine(cls, engine, device: int = 0) -> "Allocator":
        """An Allocator over an existing, configured engine (e.g. the
        process-wide one of ``cxlalloc.enable()``, ``_C.current_engine()``),
        sharing its tiers, limits and statistics.  ``config`` is None.

        Raises:
            ValueError: ``device`` is not configured in ``engine``.
        """
        if not engine.has_config(int(device)):
            raise ValueError(f"cxlalloc: the engine has no configuration for device {device}")
        self = cls.__new__(cls)
        self.config = None
        self._engine = engine
        self.device = int(device)
        self.node_reason = "the process-wide engine's choice"
        self._dev = engine.device(self.device)
        self.simulated = bool(engine.simulated)
        return self

    # ------------------------------------------------------------ raw memory
    def malloc(self, nbytes: int, tag: str = "other", stream: int = 0) -> int:
        """Allocate ``nbytes`` bytes of class ``tag`` ("kv", "weight", "other").

        Returns the device address (int; also CPU-addressable in simulation).
        0 for ``nbytes == 0``.  Blocks are cached and reused per ``stream``
        (a ``cudaStream_t`` as int; 0 = the default stream).

        Raises:
            cxlalloc.OutOfMemoryError: neither tier can hold it (the message
                gives the request, each tier's use and limit, and the node).
            ValueError: unknown tag, or ``stream`` is not a live CUDA stream
                (the driver is asked; the message names ``stream``).
        """
        return self._dev.malloc(_nbytes(nbytes), _stream(stream), _check_tag(tag))

    def free(self, ptr: int) -> None:
        """Free a pointer returned by :meth:`malloc`.

        Raw pointers belong to this Allocator: deleting the Allocator frees
        them (tensors and extents keep it alive instead).

        Raises:
            cxlalloc.InvalidFreeError: not allocated here, an interior
                pointer, or already freed (nothing is modified).
        """
        self._dev.free(_ptr(ptr))

    def record_stream(self, ptr: int, stream: int) -> None:
        """Mark ``ptr`` as used on ``stream``: after :meth:`free` it is reused
        only once the work queued on ``stream`` so far has completed."""
        self._dev.record_stream(_ptr(ptr), _stream(stream))

    def tier_of(self, ptr) -> str:
        """``"device"`` or ``"host"``: where the byte at ``ptr`` lives now.
        ``ptr`` may also be a tensor (its storage's first byte).

        Raises:
            ValueError: ``ptr`` is not memory of this allocator (the message
                describes a tensor by shape and dtype, never by its values).
        """
        if hasattr(ptr, "untyped_storage"):
            addr = int(ptr.untyped_storage().data_ptr())
            try:
                return self._dev.tier_of(addr)
            except ValueError:
                raise ValueError(f"cxlalloc: the storage of {_show(ptr)} on {ptr.device} (address {addr:#x}) is not "
                                 "memory of this allocator") from None
        return self._dev.tier_of(_ptr(ptr))

    def migrate(self, ptr: int, tier: str, length: int = 1) -> int:
        """Move the segment holding ``ptr`` (or, in an extent, the chunks
        overlapping ``[ptr, ptr+length)``) to ``tier``, address unchanged and
        bytes intact.  Returns bytes moved.

        A segment holds several blocks on the same pages: if one of them is a live block another thread
        allocated, the move is refused (it would remap that thread's memory under it), unless the allocator
        was made with ``implicit_moves="any-thread"``.

        Raises:
            cxlalloc.UnsupportedError: the backend cannot remap (``pinned``), or the segment also holds
                another thread's live block.
            cxlalloc.OutOfMemoryError: the target tier has no room.
            ValueError: in an extent, ``length`` runs past its end (the
                message names ``length`` and the allowed range).
        """
        return self._dev.migrate(_ptr(ptr), _nbytes(length, "length"), _check_tier(tier))

    def demote(self, ptr: int, length: int = 1) -> int:
        """:meth:`migrate` to the host tier."""
        return self.migrate(ptr, "host", length)

    def promote(self, ptr: int, length: int = 1) -> int:
        """:meth:`migrate` to the device tier."""
        return self.migrate(ptr, "device", length)

    def rebalance(self) -> int:
        """Promote hot host-tier KV back to VRAM while it has room beyond the
        headroom, within the migration budget.  Returns bytes promoted."""
        return self._dev.rebalance()

    def mark_step(self) -> None:
        """Start a new step (e.g. a decode step): memory used from now on is
        the working set that demotion never picks."""
        self._dev.mark_step()

    def empty_cache(self) -> int:
        """Wait for pending frees and return all cached free segments of both
        tiers to the driver.  Returns bytes released."""
        return self._dev.empty_cache()

    # ------------------------------------------------------------ tensors
    def _dl_device(self):
        return (_DL_CPU, 0) if self.simulated else (_DL_CUDA, self.device)

    def tensor(self, shape: Sequence[int], dtype=None, tag: str = "other", stream: Optional[int] = None):
        """A torch tensor of ``shape``/``dtype`` whose storage comes from
        this allocator (class ``tag``).  On a GPU it is a ``cuda:N`` tensor
        (also when its bytes live on the host tier); in simulation a CPU
        tensor.  The memory is freed when the tensor's storage dies.

        Raises:
            cxlalloc.OutOfMemoryError, ValueError: as :meth:`malloc`.
        """
        import torch

        dtype = dtype or torch.float32
        shape = tuple(shape)
        try:  # any integer type (Python, NumPy, a 0-d integer tensor), never a bool
            if any(isinstance(s, bool) for s in shape):
                raise TypeError
            shape = tuple(operator.index(s) for s in shape)
        except TypeError:
            raise ValueError(f"cxlalloc: shape {shape!r} must be non-negative ints") from None
        if any(s < 0 for s in shape):
            raise ValueError(f"cxlalloc: shape {shape!r} must be non-negative ints")
        elem = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * elem
        dev_type, dev_id = self._dl_device()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device="cpu" if self.simulated else f"cuda:{dev_id}")
        if stream is None:
            stream = 0 if self.simulated else torch.cuda.current_stream(dev_id).cuda_stream
        ptr = self._dev.malloc(_nbytes(nbytes, "the tensor's size in bytes"), _stream(stream), _check_tag(tag))
        # dlpack() takes ownership of the block (it frees it itself if it
        # fails): from here it is freed with the tensor, and free(ptr) is refused.
        cap = self._dev.dlpack(ptr, nbytes, dev_type, dev_id)
        return torch.from_dlpack(cap).view(dtype).view(shape)

    def extent(self, capacity: int, tag: str = "kv") -> "Extent":
        """Reserve a growable buffer of ``capacity`` bytes at a fixed address
        (see :class:`Extent`).  Nothing is committed until :meth:`Extent.grow`
        (with a remappable backend; ``pinned`` commits it whole now)."""
        return Extent(self, self._dev.extent(parse_size(capacity, "capacity"), _check_tag(tag)))

    # ------------------------------------------------------------ introspection
    def stats(self) -> dict:
        """Per-tier and per-class statistics (all sizes in bytes).

        Keys: ``device``/``host`` → ``allocated_bytes``, ``reserved_bytes``,
        ``limit_bytes``, ``peak_allocated_bytes``, ``peak_reserved_bytes``,
        ``segments`` (host also ``numa_node``, ``backend``, ``placement``:
        verified/misplaced/unverified bytes and the method); ``kv``/
        ``weight``/``other`` → ``device_bytes``, ``host_bytes``,
        ``peak_device_bytes``, ``peak_host_bytes``; counters
        ``spilled_bytes`` (cumulative bytes served by the host tier),
        ``demoted_bytes``, ``promoted_bytes``, ``reclaimed_bytes``,
        ``cache_hits``, ``invalid_frees``, ``ooms``, ``deferred_moves`` /
        ``deferred_moves_done`` (implicit KV moves queued for the owner
        thread / carried out by it), ``parked_frees`` / ``parked_extents``
        (tensor frees and extent releases that failed in a destructor,
        retried at the next call), ...; ``torch``: the
        device tier in ``torch.cuda.memory_stats()`` keys.
        """
        return self._dev.stats()

    def reset_peak_stats(self) -> None:
        self._dev.reset_peak_stats()

    def snapshot(self) -> list:
        """Every segment with its blocks (address, size, tier, class, backing)."""
        return self._dev.snapshot()

    def info(self) -> dict:
        """Resolved configuration, backend support on this GPU, granularity."""
        d = self._dev.info()
        d["node_reason"] = self.node_reason
        d["simulated"] = self.simulated
        return d

    def check_invariants(self) -> None:
        """Recompute all accounting from scratch; raise RuntimeError on any
        mismatch (used by tests after randomized operation sequences)."""
        self._dev.check_invariants()

    def __repr__(self) -> str:
        mode = "simulated" if self.simulated else "cuda"
        return f"<cxlalloc.Allocator {mode}:{self.device} {self._dev.describe_tiers()}>"


class Extent:
    """A growable buffer at a fixed address: the storage of a KV cache layer.

    Address space for ``capacity`` bytes is reserved up front; physical
    chunks are committed by :meth:`grow`, each placed by the KV policy (the
    newest on the device while the KV quota allows, older ones demoted to the
    host tier), so growing never copies existing bytes and the whole buffer
    stays one contiguous view.  The extent is released when this object and
    every tensor from :meth:`tensor` are gone.
    """

    def __init__(self, allocator: Allocator, handle):
        self._alloc = allocator
        self._h = handle

    base = property(lambda self: self._h.base, doc="Address of byte 0 (int).")
    capacity = property(lambda self: self._h.capacity, doc="Reserved bytes.")
    chunk_bytes = property(lambda self: self._h.chunk_bytes, doc="Commit granularity in bytes.")
    lazy = property(lambda self: self._h.lazy, doc="True if chunks commit on demand.")
    committed = property(lambda self: self._h.committed, doc="Physically backed bytes.")

    def grow(self, nbytes: int) -> None:
        """Make ``[0, nbytes)`` physically backed.

        Raises:
            ValueError: beyond the capacity.
            cxlalloc.OutOfMemoryError: no tier has room for a chunk.
        """
        self._h.grow(_nbytes(nbytes))

    def trim(self, nbytes: int) -> None:
        """Release chunks wholly beyond ``nbytes`` (crop / reset), except
        those under a live :meth:`tensor` view (released by a later trim,
        once the view is gone)."""
        self._h.trim(_nbytes(nbytes))

    def touch(self) -> None:
        """Record a use of every committed chunk (drives promotion)."""
        self._h.touch()

    def tiers(self) -> list:
        """``[(offset, length, "device"|"host"|"none"), ...]`` covering the capacity."""
        return [tuple(t) for t in self._h.tiers()]

    def tensor(self, dtype=None):
        """A 1-D tensor of ``dtype`` over the committed prefix: ``committed``
        bytes (0 before the first :meth:`grow`), never beyond, since reading
        memory that is not committed faults (on a GPU it kills the CUDA
        context).  Take a new one after :meth:`grow` to see the new bytes.
        Keeps the extent alive, and the chunks under it committed: a
        :meth:`trim` releases them only once no view covers them."""
        import torch

        dev_type, dev_id = self._alloc._dl_device()
        t = torch.from_dlpack(self._h.dlpack(dev_type, dev_id))
        return t if dtype is None or dtype == torch.uint8 else t.view(dtype)
