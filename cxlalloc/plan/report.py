"""The plan on the terminal (a rich table) and as a plot (matplotlib, imported lazily)."""

from __future__ import annotations

from typing import Any, Dict, List


def _b(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(v) -> str:
    return "-" if v is None else (f"{v:,.1f} ms" if v < 10000 else f"{v / 1000:,.1f} s")


def rows(rec: Dict[str, Any]) -> List[tuple]:
    """(section, quantity, value) rows of the table."""
    kv, cap, gp, tt, de, hw, vr = rec["kv"], rec["capacity"], rec["gpus"], rec["ttft"], rec["decode"], \
        rec["hardware"], rec["vram"]
    out = [("model", "layers (kinds)", ", ".join(f"{k} x{v}" for k, v in rec["model"]["layer_kinds"].items())),
           ("model", "parameters", f"{rec['model']['params'] / 1e9:.2f} B ({rec['model']['params_source']})")]
    for k, v in kv["bytes_per_token"].items():
        out.append(("KV", f"bytes per token: {k}", f"{v:,} B"))
    if kv["sliding_windows"]:
        out.append(("KV", "sliding windows (tokens)", ", ".join(map(str, kv["sliding_windows"]))))
    if kv["state_bytes_per_sequence"]:
        out.append(("KV", "fixed state per sequence (untiered)", _b(kv["state_bytes_per_sequence"])))
    out += [("KV", f"per sequence at {rec['inputs']['context']:,} tokens", _b(kv["per_sequence_live_bytes"])),
            ("KV", f"{rec['inputs']['users']} sequences (engine chunks)", _b(kv["target_cache_bytes"])),
            ("VRAM per GPU", "total / weights / headroom",
             f"{_b(vr['per_gpu_bytes'])} / {_b(vr['weights_per_gpu'])} / {_b(vr['headroom_per_gpu'])}"),
            ("VRAM per GPU", "room for KV", _b(vr["kv_room_per_gpu"])),
            ("capacity", "GPUs per model copy", str(cap["group_gpus"])),
            ("capacity", "sequences per GPU, VRAM only", f"{cap['sequences_per_gpu_vram_only']:g}"),
            ("capacity", "sequences per GPU, with host tier", f"{cap['sequences_per_gpu_with_host']:g}"),
            ("decode", "TPOT bound, VRAM only, at its capacity", _ms(de["tpot_ms_vram_only"])),
            ("decode", f"TPOT bound, with host tier, {de['sequences_per_group_at_target']} sequences per copy",
             _ms(de["tpot_ms_with_host"]) + f" ({de['host_share_with_host']:.0%} of KV on host)"),
            ("TTFT", "cold (prefill)", _ms(tt["cold_ms"])),
            ("TTFT", f"warm ({tt['prefix_tokens']:,} prefix tokens loaded)",
             _ms(tt["warm_ms"]) + f" (load {_ms(tt['prefix_load_ms'])})"),
            ("host/CXL", "bytes needed per GPU (spilled KV)", _b(rec["host"]["bytes_needed_per_gpu"])),
            ("host/CXL", "reuse pool, upper bound", _b(rec["host"]["reuse_pool_bytes_upper"])),
            ("GPUs", f"for {rec['inputs']['users']} users: without / with host tier",
             f"{gp['without_host']} / {gp['with_host']}"
             + (f"  (ratio {gp['ratio']:.2f})" if gp["ratio"] else "")),
            ("GPUs", "capacity only (no TPOT target)",
             f"{gp['without_host_capacity_only']} / {gp['with_host_capacity_only']}"
             + (f"  (ratio {gp['ratio_capacity_only']:.2f}, TPOT {_ms(gp['tpot_ms_capacity_only'])})"
                if gp["ratio_capacity_only"] else "")),
            ("hardware", "host/CXL memory per GPU", f"{_b(hw['host_bytes_per_gpu'])} ({hw['host_bytes_source']})"),
            ("hardware", "HBM", f"{hw['hbm_gbps']:,.0f} GB/s ({hw['hbm_gbps_source']})"),
            ("hardware", "host read", f"{hw['host_read_gbps']:,.1f} GB/s = min(link {hw['link_gbps']:.1f}: "
             f"{hw['link_source']}; node {hw['host_node_gbps']:.0f}: {hw['host_node_source']})")]
    out += per_gpu_rows(rec)
    return out


def per_gpu_rows(rec: Dict[str, Any]) -> List[tuple]:
    """One row per GPU of a model copy (its layers, weights, KV in VRAM and on
    its host/CXL tier, the node and link of that tier) and one per NUMA node,
    at the operating point (``decode.sequences_per_group_at_target`` sequences)."""
    par = rec.get("parallel") or {}
    if par.get("gpus", 1) <= 1 and not par.get("gpus_given"):
        return []
    u = rec["decode"]["sequences_per_group_at_target"]
    sec = f"per GPU ({par.get('mode')}, {u} seq.)"
    out = []
    for x in rec["per_gpu"]:
        node = "node unknown (give --info)" if x["node"] is None else f"node {x['node']} ({x['node_kind']})"
        heads = f", {x['kv_heads']} KV heads" if x.get("kv_heads") else ""
        out.append((sec, f"GPU {x['gpu']}: layers {x['layers'][0]}-{x['layers'][1] - 1}{heads}",
                    f"weights {_b(x['weights_bytes'])}, KV {_b(x['kv_bytes'])} (VRAM {_b(x['kv_vram_bytes'])}, "
                    f"host/CXL {_b(x['host_bytes'])}); tier on {node} via {x['link']} "
                    f"({x['host_read_gbps']:.0f} GB/s read)"))
    for nd in rec["per_node"]:
        name = "NUMA node unknown" if nd["node"] is None else f"NUMA node {nd['node']}"
        size = f" of {_b(nd['node_bytes'])}" if nd.get("node_bytes") else ""
        out.append(("per NUMA node", f"{name}: GPUs {', '.join(map(str, nd['gpus']))}",
                    f"host/CXL {_b(nd['host_bytes'])}{size} per model copy"))
    return out


def print_table(rec: Dict[str, Any], file=None) -> None:
    """The plan as a table, then its assumptions and notes (rich; plain text when not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    con = Console(file=file, width=140)
    t = Table(title=f"cxlalloc plan: {rec['model']['name']} on {rec['hardware']['gpu']}", show_lines=False)
    for c in ("", "quantity", "value"):
        t.add_column(c)
    last = None
    for sec, q, v in rows(rec):
        t.add_row(sec if sec != last else "", q, v)
        last = sec
    con.print(t)
    con.print("Assumptions: " + "; ".join(rec["assumptions"]) + ".", highlight=False)
    if rec["model"]["notes"]:
        con.print("Config notes: " + "; ".join(rec["model"]["notes"]) + ".", highlight=False)
    con.print("Formulas and sources: docs/planning.md.", highlight=False)


def plot(rec: Dict[str, Any], path: str) -> str:
    """Two panels: sequences per GPU against context (VRAM only / with host
    tier) and the TPOT bound against users at the planned context.  Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, g = rec["curves"], rec["capacity"]["group_gpus"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(c["contexts"], [u / g for u in c["sequences_per_group_vram_only"]], "o-", label="VRAM only")
    a.plot(c["contexts"], [u / g for u in c["sequences_per_group_with_host"]], "s-", label="with host/CXL tier")
    a.set_xscale("log", base=2)
    a.set_xlabel("context (tokens)")
    a.set_ylabel("sequences per GPU")
    slo = rec["inputs"]["tpot_slo_ms"]
    a.set_title("capacity" + (f" (TPOT <= {slo:g} ms)" if slo else ""))
    a.legend()
    for key, style, label in (("tpot_ms_vram_only", "o-", "VRAM only"), ("tpot_ms_with_host", "s-", "with host/CXL tier")):
        pts = [(u, t) for u, t in zip(c["users"], c[key]) if t is not None]
        if pts:
            b.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    if slo:
        b.axhline(slo, color="grey", linestyle="--", label="TPOT target")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel(f"users per model copy ({g} GPU)" if g == 1 else f"users per model copy ({g} GPUs)")
    b.set_ylabel("TPOT bound (ms)")
    b.set_title(f"decode at {rec['inputs']['context']:,} tokens")
    b.legend()
    fig.suptitle(f"{rec['model']['name']} on {rec['hardware']['gpu']} (planned, not measured)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
