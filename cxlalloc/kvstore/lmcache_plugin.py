"""Alias kept so that LMCache YAML written before the plugin moved still loads:
``remote_storage_plugin.cxlalloc.module_path: cxlalloc.kvstore.lmcache_plugin`` gets
:mod:`cxlalloc.kvstore.engines.lmcache_plugin`, the same module object.  New configs name
``cxlalloc.kvstore.engines.lmcache_plugin`` (``cxlalloc info``, docs/engines.md)."""

import sys

from cxlalloc.kvstore.engines import lmcache_plugin as _moved

sys.modules[__name__] = _moved
