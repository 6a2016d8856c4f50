"""Numbers as the benchmark report writes them (:mod:`cxlalloc_apps.bench.report`'s
tables, :mod:`cxlalloc_apps.bench.plots`' titles): one decimal by default, ``–``
for a missing value, the value itself when the format does not apply."""

GiB = 1 << 30


def _f(x, fmt="{:.1f}", none="–") -> str:
    if x is None:
        return none
    try:
        return fmt.format(x)
    except (ValueError, TypeError):
        return str(x)


def _ratio(x) -> str:
    return _f(x, "{:.2f}×")


def _pct(x) -> str:
    return _f(None if x is None else 100 * x, "{:.0f} %")


def _gib(x) -> str:
    return _f(None if x is None else x / GiB, "{:.1f} GiB")
