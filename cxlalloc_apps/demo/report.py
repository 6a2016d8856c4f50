"""The demo's report: rich tables on stdout, and the same numbers as JSON."""

from __future__ import annotations

from typing import Optional

from cxlalloc.config import format_bytes


def _ms(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:,.1f} ms"


def _rate(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:,.1f} tok/s"


def _pick_steps(n: int, k: int = 5):
    """Up to ``k`` decode step indices spread over 1..n-1 (0 is the prefill)."""
    if n <= 1:
        return []
    if n - 1 <= k:
        return list(range(1, n))
    return sorted({1 + round(i * (n - 2) / (k - 1)) for i in range(k)})


class Report:
    """Collects a demo run and prints it (rich) or returns it as a dict."""

    def __init__(self, run: dict):
        self.run = run
        self.data: dict = {}

    def add_run(self, **kw) -> None:
        self.data.update(kw)

    # ------------------------------------------------------------ json
    def as_json(self) -> dict:
        d = self.data
        plain = d.get("plain")
        if plain is not None:
            plain = {k: v for k, v in plain.items() if k != "sequences"}
        stats = d["stats"]
        return {
            "run": self.run,
            "cxlalloc": {
                "timing": d["timing"], "wall_s": d["wall_s"], "new_tokens": d["new_tokens"],
                "tiers": {t: stats[t] for t in ("device", "host")},
                "classes": {c: stats[c] for c in ("kv", "weight", "other")},
                "counters": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
                "kv_cache": d["kv"], "kv_host_token_ranges": d["host_tokens"],
            },
            "plain": plain,
            "identical_tokens": d.get("identical"),
            "texts": d["texts"],
        }

    # ------------------------------------------------------------ rich
    def print(self, console=None) -> None:
        from rich.console import Console
        from rich.panel import Panel
        from rich.table import Table

        import sys

        con = console or Console(width=None if sys.stdout.isatty() else 110)
        r, d = self.run, self.data
        stats, kv, plain = d["stats"], d["kv"] or {}, d.get("plain")

        t = Table(title="Run", show_header=False, title_justify="left")
        t.add_column("", style="bold")
        t.add_column("")
        t.add_row("mode", "SIMULATION (simulated CUDA driver, CPU compute)" if r["mode"] == "simulation"
                  else f"GPU: {r['gpu']}")
        t.add_row("model", f"{r['model']} [{r['dtype']}]")
        t.add_row("versions", f"transformers {r['transformers']}, torch {r['torch']}")
        t.add_row("SDPA backends", r.get("sdpa_backends", "torch's default choice"))
        t.add_row("batch x prompt", f"{r['batch']} x {r['prompt_tokens']} tokens (left-padded)")
        t.add_row("new tokens", f"{d['new_tokens']} per sequence (max {r['max_new_tokens']}, greedy)")
        t.add_row("device limit", f"{format_bytes(r['device_limit'])} ({r['device_limit_note']})")
        t.add_row("weights", format_bytes(r["weight_bytes"]))
        t.add_row("KV cache need", f"{format_bytes(kv.get('kv_live_bytes', r['kv_need_est_bytes']))} "
                                   f"({format_bytes(kv.get('bytes_per_token', r['kv_bytes_per_token_est']))}/token)")
        t.add_row("host tier", f"NUMA node {stats['host'].get('numa_node')}, backend {stats['host'].get('backend')}, "
                               f"limit {format_bytes(stats['host']['limit_bytes'])}")
        con.print(t)

        t = Table(title="Speed", title_justify="left")
        for c in ("run", "TTFT", "prefill", "decode", "TPOT", "wall"):
            t.add_column(c, justify="right" if c != "run" else "left")
        rows = [("cxlalloc", d["timing"], d["wall_s"])]
        if plain is not None:
            rows.append(("plain transformers (no limit)", plain["timing"], plain["wall_s"]))
        for name, tm, wall in rows:
            t.add_row(name, _ms(tm["ttft_ms"]), _rate(tm["prefill_tok_s"]), _rate(tm["decode_tok_s"]),
                      _ms(tm["tpot_ms"]), f"{wall:.2f} s")
        con.print(t)
        if r["mode"] == "simulation":
            con.print("  speeds are this CPU's (simulation), not a GPU's")

        t = Table(title="Memory by tier and class (cxlalloc, after generate)", title_justify="left")
        for c in ("class", "device", "device peak", "host", "host peak"):
            t.add_column(c, justify="right" if c != "class" else "left")
        for c in ("kv", "weight", "other"):
            s = stats[c]
            t.add_row(c, format_bytes(s["device_bytes"]), format_bytes(s["peak_device_bytes"]),
                      format_bytes(s["host_bytes"]), format_bytes(s["peak_host_bytes"]))
        dv, hs = stats["device"], stats["host"]
        t.add_row("tier total (reserved)", format_bytes(dv["reserved_bytes"]), format_bytes(dv["peak_reserved_bytes"]),
                  format_bytes(hs["reserved_bytes"]), format_bytes(hs["peak_reserved_bytes"]))
        t.add_row("tier limit", format_bytes(dv["limit_bytes"]), "", format_bytes(hs["limit_bytes"]), "")
        con.print(t)
        if r["mode"] == "simulation":
            con.print("  activations are torch's own CPU memory in simulation and are not counted")

        t = Table(title="Spill", show_header=False, title_justify="left")
        t.add_column("", style="bold")
        t.add_column("")
        t.add_row("spilled (placed on host)", format_bytes(stats["spilled_bytes"]))
        t.add_row("demoted (device -> host)", f"{format_bytes(stats['demoted_bytes'])} in {stats['demotions']} moves")
        t.add_row("promoted (host -> device)", format_bytes(stats["promoted_bytes"]))
        ranges = d["host_tokens"]
        live = kv.get("live_tokens", 0)
        if ranges:
            on_host = sum(b - a for a, b in ranges)
            desc = ", ".join(f"{a}..{b}" for a, b in ranges)
            where = ("all of them: the device budget holds no KV" if on_host >= live
                     else "the oldest; the newest stay in VRAM")
            t.add_row("KV tokens on the host tier", f"{desc} ({on_host} of {live}: {where})")
        else:
            t.add_row("KV tokens on the host tier", f"none of {live}")
        con.print(t)

        steps = kv.get("step_bytes_copied") or []
        ctx = kv.get("step_context_tokens") or []
        bpt = kv.get("bytes_per_token", 0)
        dyn = plain["step_bytes_copied"] if plain is not None else None
        t = Table(title="KV bytes copied per step", title_justify="left")
        for c in ("step", "context tokens", "cxlalloc", "transformers DynamicCache"):
            t.add_column(c, justify="right")
        if steps:
            t.add_row("prefill", str(ctx[0]), format_bytes(steps[0]),
                      format_bytes(dyn[0]) + " (measured)" if dyn else format_bytes(ctx[0] * bpt) + " (computed)")
        for i in _pick_steps(len(steps)):
            if dyn and i < len(dyn):
                other = format_bytes(dyn[i]) + " (measured)"
            else:
                other = format_bytes(ctx[i] * bpt) + " (computed: torch.cat of the whole cache)"
            t.add_row(f"decode {i}", str(ctx[i]), format_bytes(steps[i]), other)
        con.print(t)
        con.print(f"  cxlalloc writes only the new token's K/V ({format_bytes(bpt)}) per decode step; "
                  f"regrowths: {kv.get('regrowths', 0)}; KV re-copied: {format_bytes(kv.get('bytes_copied_existing', 0))}")

        if plain is not None:
            t = Table(title="Plain transformers", show_header=False, title_justify="left")
            t.add_column("", style="bold")
            t.add_column("")
            t.add_row("no limit", f"weights {format_bytes(plain['weight_bytes'])} + KV {format_bytes(plain['kv_bytes'])}"
                                  f" = {format_bytes(plain['need_bytes'])}; tokens identical to cxlalloc: "
                                  f"{'yes' if d['identical'] else 'NO'}")
            cap = plain["capped"]
            if cap.get("simulated"):
                verdict = ("would not fit" if not cap["fits"] else "would fit") + \
                    f": weights + KV = {format_bytes(plain['need_bytes'])} vs device limit " \
                    f"{format_bytes(r['device_limit'])} (measured bytes; in simulation no OOM can happen, none is claimed)"
            elif cap.get("oom"):
                verdict = f"OOM under set_per_process_memory_fraction: {cap['error']}"
            else:
                verdict = f"finished under the cap (peak {format_bytes(cap['peak_bytes'])})"
            t.add_row("same device limit", verdict)
            con.print(t)

        for i, text in enumerate(d["texts"]):
            con.print(Panel(text.strip() or "(empty)", title=f"text {i}" if len(d["texts"]) > 1 else "text",
                            title_align="left"))
        if d.get("identical") is not None:
            n = d["new_tokens"]
            print(f"Identical tokens: {'yes' if d['identical'] else 'NO'} (cxlalloc vs plain transformers without a "
                  f"limit, {r['batch']} x {n} new tokens)", flush=True)
