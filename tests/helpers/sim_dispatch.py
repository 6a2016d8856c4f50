"""A simulated stand-in for accelerate's dispatch of a model over 2 or 4 GPUs.

What it stands in for: ``from_pretrained(..., device_map="auto")`` on a machine
with N GPUs, where accelerate computes a device map (``infer_auto_device_map``:
whole decoder layers per GPU, in order, within each GPU's ``max_memory``) and
``dispatch_model`` moves each module's parameters to its ``cuda:i`` and sets
``model.hf_device_map``.

What is real: the device map is accelerate's own ``infer_auto_device_map`` over
the model's real module sizes, with ``max_memory`` split evenly over N GPUs
(raised by 10% steps until nothing lands on 'disk').  What is simulated: the
torch of CI has no CUDA, so the parameters cannot be moved to ``cuda:1``; the
model stays on the CPU with ``model.hf_device_map`` set as dispatch_model sets
it, and :func:`cxlalloc.hf.wrap` (simulation) reads that map to give each
simulated GPU of cxlalloc's simulated driver its own allocator, device budget
and host tier: each layer's KV and each parameter live in the allocator of the
GPU the map names.  The forward itself runs on the CPU (no cross-device copies
between layers are exercised: scripts/gpu_check.sh runs that on real GPUs).
"""

from __future__ import annotations

import contextlib

from tests.helpers.gc_util import collect_all

from cxlalloc import _sim
import cxlalloc.engine as engine


def accelerate_device_map(model, gpus: int) -> dict:
    """accelerate's ``infer_auto_device_map`` of ``model`` over ``gpus`` GPUs of
    equal memory (the least, in 10% steps above an even split, that leaves
    nothing on 'disk').  Returns ``{module name: GPU index}``."""
    from accelerate.utils import compute_module_sizes, infer_auto_device_map

    total = compute_module_sizes(model)[""]
    factor = 1.0
    while factor < 4:
        mm = {i: int(total / gpus * factor) for i in range(gpus)}
        dm = dict(infer_auto_device_map(model, max_memory=mm, no_split_module_classes=model._no_split_modules))
        if all(isinstance(v, int) for v in dm.values()):
            return dm
        factor += 0.1
    raise AssertionError(f"accelerate placed part of the model off the GPUs: {dm}")


def dispatch(model, gpus: int) -> dict:
    """Set ``model.hf_device_map`` to :func:`accelerate_device_map` (what
    ``dispatch_model`` sets; the parameters stay on the CPU).  Returns the map."""
    dm = accelerate_device_map(model, gpus)
    model.hf_device_map = dm
    return dm


@contextlib.contextmanager
def simulated_gpus(n: int, vram: str = "1GiB"):
    """The simulated driver configured with ``n`` GPUs of ``vram`` each for a
    with-block (nothing simulated may be alive at entry or exit); back to one
    GPU after it."""
    collect_all()
    sim = _sim.Sim()
    sim.configure(f"devices={n},vram={vram}")
    engine._sim_vram = sim.parse_size(vram)
    try:
        yield sim
    finally:
        collect_all()
        try:
            sim.configure(f"devices=1,vram={vram}")
        except ValueError:
            pass  # something is still alive (a failing test): the next fresh_sim reconfigures

