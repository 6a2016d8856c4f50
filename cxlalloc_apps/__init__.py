"""The applications shipped beside the cxlalloc product, in the same wheel.

    cxlalloc_apps.bench   the benchmark suite and the report generator   (``cxlalloc bench``)
    cxlalloc_apps.demo    the main job: generate() past the VRAM budget    (``cxlalloc demo``,
                          ``examples/generate.py``)

They are users of cxlalloc: they import its public API (``cxlalloc``,
``cxlalloc.hf``, ``cxlalloc.kvstore``; the few other pieces they still use are
listed in CONTRIBUTING.md, "Import directions"), never each other; what both
need lives here at the top (``usage``, ``third_party``).  The product finds
them through the ``cxlalloc.apps`` entry-point group declared in setup.py and
never imports them (tests/app/test_import_rules.py checks both directions).
"""
