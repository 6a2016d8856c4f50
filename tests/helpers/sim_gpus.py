"""Several simulated GPUs for one test: the simulated driver models a device
count (``devices=N`` in its spec, csrc/sim/state.cpp); each device has its own
VRAM of the same size.  Used with the ``fresh_sim`` fixture (nothing live
before), as ``with sim_gpus(sim, 2): ...``; the single default GPU is
restored afterwards."""

import contextlib

from tests.helpers.gc_util import collect_all

from cxlalloc import engine as _engine


@contextlib.contextmanager
def sim_gpus(sim, n: int, vram: str = "1GiB"):
    sim.configure(f"devices={n},vram={vram}")
    _engine._sim_vram = sim.parse_size(vram)  # engines made now keep this size (no reconfiguration)
    try:
        yield sim
    finally:
        collect_all()
        sim.configure(f"vram={vram}")  # devices back to the default one
