"""``cxlalloc.memory_summary()``: cxlalloc's tiers as a readable table
(rendered with ``rich`` when it is installed)."""

from __future__ import annotations

import sys
from typing import Optional

from cxlalloc.config import format_bytes
from cxlalloc.pytorch.devices import current_device
from cxlalloc.pytorch.memory import stats


def memory_summary(device=None, use_rich: Optional[bool] = None) -> str:
    """A readable table of cxlalloc's tiers for ``device`` (default: current).

    Rows: device and host tier (allocated, reserved, peaks, limit), KV /
    weight / other bytes per tier, spilled / demoted / promoted totals, the
    host NUMA node and why it was chosen, the backend and the mode.  Rendered
    with ``rich`` when it is installed (``use_rich=False`` forces plain text).

    Raises:
        RuntimeError: cxlalloc is not enabled.
    """
    s = stats(device)
    d = current_device(device)
    return format_summary(s, title=f"cxlalloc memory summary (cuda:{d}, mode {s.get('mode')})", use_rich=use_rich)


def format_summary(s: dict, title: str = "cxlalloc memory summary", use_rich: Optional[bool] = None) -> str:
    """Render a :func:`stats`-style dict as a table (see :func:`memory_summary`)."""
    dev, host = s["device"], s["host"]
    fb = format_bytes
    tier_rows = [
        ["device tier (VRAM)", fb(dev["allocated_bytes"]), fb(dev["reserved_bytes"]), fb(dev["peak_allocated_bytes"]),
         fb(dev["peak_reserved_bytes"]), fb(dev["limit_bytes"])],
        [f"host tier (NUMA node {host['numa_node']})", fb(host["allocated_bytes"]), fb(host["reserved_bytes"]),
         fb(host["peak_allocated_bytes"]), fb(host["peak_reserved_bytes"]), fb(host["limit_bytes"])],
    ]
    class_rows = [[name, fb(s[key]["device_bytes"]), fb(s[key]["host_bytes"]), fb(s[key]["peak_device_bytes"]),
                   fb(s[key]["peak_host_bytes"])] for key, name in (("kv", "KV cache"), ("weight", "weights"),
                                                                     ("other", "other"))]
    facts = [
        ("spilled", f"{fb(s['spilled_bytes'])} in {s['spilled_allocations']} allocations"),
        ("demoted", f"{fb(s['demoted_bytes'])} ({s['demotions']} moves)"),
        ("promoted", f"{fb(s['promoted_bytes'])} ({s['promotions']} moves)"),
        ("NUMA node", f"{host['numa_node']}: {s.get('numa_node_reason') or 'n/a'}"),
        ("backend", str(host.get("backend"))),
        ("mode", str(s.get("mode"))),
    ]
    if "spill_reserved_bytes" in s:
        facts.append(("spill pool (scoped)", fb(s["spill_reserved_bytes"])))
    tier_head = ["tier", "allocated", "reserved", "peak allocated", "peak reserved", "limit"]
    class_head = ["class", "on device", "on host", "peak on device", "peak on host"]

    rich = None
    if use_rich is not False:
        try:
            import rich.console
            import rich.table

            rich = sys.modules["rich"]
        except ImportError:
            if use_rich:
                raise
    if rich is not None:
        import io

        buf = io.StringIO()
        con = rich.console.Console(file=buf, width=120, force_terminal=False, color_system=None)
        for head, rows, t in ((tier_head, tier_rows, title), (class_head, class_rows, None)):
            table = rich.table.Table(title=t)
            for i, h in enumerate(head):
                table.add_column(h, justify="left" if i == 0 else "right")
            for r in rows:
                table.add_row(*r)
            con.print(table)
        for k, v in facts:
            con.print(f"{k}: {v}", markup=False, highlight=False)
        return buf.getvalue().rstrip("\n")

    def block(head, rows):
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        fmt = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]

    lines = [title] + block(tier_head, tier_rows) + [""] + block(class_head, class_rows) + [""]
    lines += [f"{k}: {v}" for k, v in facts]
    return "\n".join(lines)
