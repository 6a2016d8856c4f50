"""Continuous batching on cxlalloc's tiers: transformers' paged KV cache in a cxlalloc extent.

transformers serves many requests at once with continuous batching
(``model.generate_batch(...)``, ``model.init_continuous_batching(...)``, and
``transformers serve --continuous-batching``, which calls the latter;
``transformers/generation/continuous_batching/``, 5.24).  Its paged cache
(``PagedAttentionCache``, ``cache.py``) is one flat tensor of fixed-size
*blocks* (``page_size`` tokens of every layer's K and V), sized from free VRAM
when the manager starts; requests get blocks from a pool, complete blocks are
hashed for prefix sharing, and under pressure requests are preempted into a
pinned CPU swap pool (``offloading_manager.py``) or reset and re-prefilled.

On a wrapped model (:func:`cxlalloc.hf.wrap`) the same entry points run on
cxlalloc (:class:`CxlPagedAttentionCache`):

* **Blocks from cxlalloc memory, committed as used.**  The flat cache tensor
  is a cxlalloc extent of class ``kv``: address space for the whole capacity
  when the manager starts, memory (chunks, zeroed) only as far as the highest
  sector handed out (:meth:`CxlPagedAttentionCache.grow_to`); its chunks go to
  VRAM while the device budget allows and to the host tier past it, so the
  number of blocks (and of requests in flight) is bounded by device + host
  budget, not by VRAM.  Default capacity (``num_blocks=None``, a ceiling): the
  device tier's room for KV, and as much again on the host tier (at most its
  room, at least one batch's ``max_batch_tokens`` of blocks, 4 at the least:
  with no VRAM left for KV the whole cache is on the host tier); a ``num_blocks`` you set is used as given
  (refused, naming it, when device + host cannot hold it).  When neither tier
  has room for more chunks the cache stops growing (said once).
* **KV-aware placement.**  Before each batch, the chunks holding blocks of
  the requests scheduled in it are promoted to VRAM, newest block first (a
  request's last block before its earlier ones), demoting chunks that hold
  only blocks of waiting/preempted requests or cold cached prefixes
  (:func:`cxlalloc.policy.cb_moves.plan_moves`; the engine moves whole chunks, address unchanged,
  :meth:`cxlalloc.Allocator.migrate`).  Attention reads host-tier chunks in
  place either way, so placement changes speed, never tokens.
* **Prefixes that outlive their blocks** (``wrap(..., kv_store=...)``): every
  block the cache hashes as complete is written to the KV store
  (:mod:`cxlalloc.kvstore`: the same chained keys and model fingerprint as
  ``generate()``'s reuse, with ``page_size`` tokens per stored block), so when
  continuous batching later evicts it (and forgets its hash) the prefix is not
  lost; a new request whose prefix misses in the paged cache is looked up in
  the store and the stored blocks are copied into fresh blocks (hashed, so
  later requests share them) instead of being prefilled again, across
  requests, processes (a kv-server) and restarts (Redis).
* **The swap pool on the host tier.**  ``cpu_offload_space`` (GiB) is served
  from cxlalloc's host tier (the chosen NUMA/CXL node) instead of a pinned
  ``torch.empty(..., pin_memory=True)``, sized to exactly the sectors asked
  (rounded up to the extent's chunk).

* **A model spread over GPUs** (accelerate's ``device_map``, pipeline of
  layers; full attention): one extent per GPU, from that GPU's allocator,
  holding its layers' pages of every block, so each GPU's blocks take its
  VRAM budget and spill to its own host tier; transformers' shared row
  indices are translated per GPU once per batch (:mod:`~cxlalloc.hf.paged.gpu_parts`).

What is not shared is said once (:class:`ContinuousBatchingWarning`): models
with sliding-window or other non-full-attention layers, where transformers
turns prefix sharing off (the store is then off too, the cache is still
tiered; spread over GPUs, such a model's paged cache is left to
transformers), and tensor parallelism (left to transformers, untiered).

Modules, by concern: ``patching`` (routing transformers' ``PagedAttentionCache``
to ours, the manager and batch hooks, :func:`install`), ``cache``
(:class:`CxlPagedAttentionCache`: sizing, the KV store through
:mod:`cxlalloc.hf.store_io`), ``gpu_parts`` (one extent per GPU of a spread
model), ``placement`` (the per-batch chunk moves; the
decision is :mod:`cxlalloc.policy.cb_moves`), ``swap_pool`` (the swap pool on
the host tier), ``stats`` (:class:`CBState`, counters), ``tf_classes``
(transformers' classes, or stand-ins where this transformers lacks them).

``hf.stats(model)["hf"]["continuous_batching"]`` reports what happened
(docs/huggingface.md#continuous-batching).  What this module relies on in
transformers' code: docs/sources.md#transformers-continuous-batching.
"""

from cxlalloc.hf.paged.cache import CxlPagedAttentionCache
from cxlalloc.hf.paged.patching import install
from cxlalloc.hf.paged.stats import CBState, ContinuousBatchingWarning
from cxlalloc.policy.cb_moves import plan_moves

__all__ = ["CxlPagedAttentionCache", "ContinuousBatchingWarning", "CBState", "install", "plan_moves"]
