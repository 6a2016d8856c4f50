#include "backend/segment_factory.h"

#include <numeric>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "common/units.h"

namespace cxl::backend {

SegmentFactory::SegmentFactory(driver::DriverPtr drv, FactoryConfig cfg, NumaOps* numa)
    : drv_(std::move(drv)), cfg_(cfg), numa_(numa) {
  size_t d = cfg_.device_granularity ? cfg_.device_granularity : (2u << 20);
  size_t h = cfg_.host_granularity ? cfg_.host_granularity : d;
  align_ = std::lcm(d, h);
}

CUmemLocation SegmentFactory::location(Tier t) const {
  if (t == Tier::Device) return {CU_MEM_LOCATION_TYPE_DEVICE, cfg_.device};
  return {CU_MEM_LOCATION_TYPE_HOST_NUMA, cfg_.host_node};
}

CUstream SegmentFactory::stream() {
  if (!stream_) stream_ = driver::Stream(drv_);
  return stream_.get();
}

void SegmentFactory::verify_host_placement(const SegmentMemory& seg, Chunk& c) {
  c.placed_ok = c.placed_wrong = c.placed_unknown = 0;
  if (c.tier != Tier::Host || !c.committed) return;
  if (numa_ == nullptr) {
    c.placed_unknown = c.size;
    return;
  }
  // The CPU address of the pages: the registered host pointer for pinned
  // segments (equal to the device pointer only where attribute 91 holds).
  const char* cpu = seg.backing == Backing::Pinned ? static_cast<const char*>(seg.pages.get())
                                                    : reinterpret_cast<const char*>(seg.base);
  auto nodes = numa_->page_nodes(cpu + c.offset, c.size);
  for (const auto& [node, bytes] : nodes) {
    if (node == cfg_.host_node)
      c.placed_ok += bytes;
    else if (node < 0)
      c.placed_unknown += bytes;
    else
      c.placed_wrong += bytes;
  }
  if (c.placed_wrong > 0) {
    std::string msg = format_bytes(c.placed_wrong) + " of a host-tier " + backing_name(seg.backing) +
                      " chunk landed outside NUMA node " + std::to_string(cfg_.host_node) +
                      " (the driver or kernel moved or refused the placement; see docs/sources.md#cpu-less-nodes)";
    if (cfg_.strict_placement) throw Error(ErrorKind::Unavailable, "strict_placement: " + msg);
    log_warning(msg);
  }
}

// ------------------------------------------------------------------ block segments
void SegmentFactory::create_block_segment(SegmentMemory& seg, size_t size, Tier tier, AllocClass cls) {
  seg.device = cfg_.device;
  seg.size = size;
  Chunk c;
  c.offset = 0;
  c.size = size;
  c.tier = tier;
  // KV segments use managed memory under the managed backend even on the
  // device tier, so that they can later be demoted by prefetch.
  bool managed_kv = cfg_.host_enabled && cfg_.host_backend == HostBackend::Managed && cls == AllocClass::KV;
  if (tier == Tier::Device && !managed_kv) {
    if (cfg_.device_vmm) {
      seg.backing = Backing::Vmm;
      seg.va = driver::VaRange(drv_, size, cfg_.device_granularity);
      seg.base = seg.va.base();
      c.phys = driver::PhysicalMemory(drv_, size, location(Tier::Device));
      c.map = driver::Mapping(drv_, seg.base, c.phys, cfg_.device, false, -1);
      grant_peers(seg.base, size);
    } else {
      seg.backing = Backing::DeviceMem;
      seg.devmem = driver::DeviceMemory(drv_, size);
      seg.base = seg.devmem.ptr();
    }
    c.committed = true;
    seg.chunks.push_back(std::move(c));
    return;
  }
  if (tier == Tier::Host && !cfg_.host_enabled)
    throw Error(ErrorKind::Internal, "host tier requested while disabled");
  HostBackend hb = managed_kv ? HostBackend::Managed : cfg_.host_backend;
  switch (hb) {
    case HostBackend::HostVmm:
      seg.backing = Backing::Vmm;
      seg.va = driver::VaRange(drv_, size, align_);
      seg.base = seg.va.base();
      c.phys = driver::PhysicalMemory(drv_, size, location(Tier::Host));
      c.map = driver::Mapping(drv_, seg.base, c.phys, cfg_.device, true, cfg_.host_node);
      grant_peers(seg.base, size);
      break;
    case HostBackend::Managed:
      seg.backing = Backing::Managed;
      seg.managed = driver::ManagedMemory(drv_, size);
      seg.base = seg.managed.ptr();
      advise_managed(seg, c, tier);
      break;
    case HostBackend::Pinned: {
      seg.backing = Backing::Pinned;
      seg.pages = HostPages(size);
      if (numa_) numa_->bind(seg.pages.get(), size, cfg_.host_node);
      // Fault the pages in under the binding before the driver pins them.
      touch_pages(seg.pages.get(), size);
      seg.reg = driver::HostRegistration(drv_, seg.pages.get(), size,
                                         CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE);
      seg.base = seg.reg.device_ptr();
      break;
    }
  }
  c.committed = true;
  seg.chunks.push_back(std::move(c));
  if (tier == Tier::Host) verify_host_placement(seg, seg.chunks.back());
}

// ------------------------------------------------------------------ managed advice
void SegmentFactory::advise_managed(const SegmentMemory& seg, const Chunk& c, Tier t) {
  CUdeviceptr p = seg.base + c.offset;
  CUmemLocation dev{CU_MEM_LOCATION_TYPE_DEVICE, cfg_.device};
  CUmemLocation where = location(t);
  CXL_CU(*drv_, cuMemAdvise, p, c.size, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, where);
  // Keep the GPU's mapping of host-resident pages so kernels read them over
  // the link instead of faulting them back (cuda.h: SET_ACCESSED_BY "avoids
  // faults where data locality is not important").
  if (t == Tier::Host) CXL_CU(*drv_, cuMemAdvise, p, c.size, CU_MEM_ADVISE_SET_ACCESSED_BY, dev);
  CUstream s = stream();
  CXL_CU(*drv_, cuMemPrefetchAsync, p, c.size, where, 0u, s);
  CXL_CU(*drv_, cuStreamSynchronize, s);
}

// ------------------------------------------------------------------ extents
bool SegmentFactory::lazy_extents() const {
  if (!cfg_.host_enabled) return cfg_.device_vmm;
  if (cfg_.host_backend == HostBackend::Managed) return true;
  return cfg_.device_vmm && cfg_.host_backend == HostBackend::HostVmm;
}

void SegmentFactory::create_extent(SegmentMemory& seg, size_t capacity, size_t chunk_bytes) {
  CXL_CHECK(lazy_extents(), "create_extent without lazy extent support");
  CXL_CHECK(chunk_bytes > 0 && capacity % chunk_bytes == 0, "extent capacity not a multiple of its chunk size");
  seg.device = cfg_.device;
  seg.size = capacity;
  if (cfg_.host_enabled && cfg_.host_backend == HostBackend::Managed) {
    seg.backing = Backing::Managed;
    seg.managed = driver::ManagedMemory(drv_, capacity);
    seg.base = seg.managed.ptr();
  } else {
    seg.backing = Backing::Vmm;
    seg.va = driver::VaRange(drv_, capacity, align_);
    seg.base = seg.va.base();
  }
  size_t n = capacity / chunk_bytes;
  seg.chunks.resize(n);
  for (size_t i = 0; i < n; ++i) {
    seg.chunks[i].offset = i * chunk_bytes;
    seg.chunks[i].size = chunk_bytes;
  }
}

void SegmentFactory::commit_chunk(SegmentMemory& seg, Chunk& c, Tier tier) {
  CXL_CHECK(!c.committed, "commit of a committed chunk");
  if (seg.backing == Backing::Vmm) {
    driver::PhysicalMemory phys(drv_, c.size, location(tier));
    driver::Mapping map(drv_, seg.base + c.offset, phys, cfg_.device, tier == Tier::Host, cfg_.host_node);
    grant_peers(seg.base + c.offset, c.size);
    c.phys = std::move(phys);
    c.map = std::move(map);
  } else if (seg.backing == Backing::Managed) {
    advise_managed(seg, c, tier);
  } else {
    throw Error(ErrorKind::Internal, "commit_chunk on a fixed segment");
  }
  c.tier = tier;
  c.committed = true;
  c.touches = 0;
  if (tier == Tier::Host) verify_host_placement(seg, c);
}

void SegmentFactory::decommit_chunk(SegmentMemory& seg, Chunk& c) {
  CXL_CHECK(c.committed, "decommit of an uncommitted chunk");
  if (seg.backing == Backing::Vmm) {
    c.map = driver::Mapping();  // unmap first, then release the handle
    c.phys = driver::PhysicalMemory();
  } else if (seg.backing == Backing::Managed) {
    // Managed pages cannot be returned piecewise before CUDA 13's discard
    // APIs; the chunk keeps its pages and its advice.  It stays counted.
    return;
  }
  c.committed = false;
  c.placed_ok = c.placed_wrong = c.placed_unknown = 0;
}

// ------------------------------------------------------------------ migration
bool SegmentFactory::can_move_between_tiers() const {
  if (!cfg_.host_enabled) return false;
  return cfg_.host_backend == HostBackend::Managed || (cfg_.device_vmm && cfg_.host_backend == HostBackend::HostVmm);
}

bool SegmentFactory::can_migrate(const SegmentMemory& seg) const {
  if (!cfg_.host_enabled) return false;
  if (seg.backing == Backing::Managed) return true;
  return seg.backing == Backing::Vmm && cfg_.device_vmm && cfg_.host_backend == HostBackend::HostVmm;
}

void SegmentFactory::migrate_chunk(SegmentMemory& seg, Chunk& c, Tier target) {
  CXL_CHECK(c.committed, "migrate of an uncommitted chunk");
  if (c.tier == target) return;
  CXL_CHECK(can_migrate(seg), "migrate of a fixed segment");
  CUdeviceptr va = seg.base + c.offset;
  if (seg.backing == Backing::Managed) {
    advise_managed(seg, c, target);
    c.tier = target;
    c.touches = 0;
    if (target == Tier::Host) verify_host_placement(seg, c);
    else c.placed_ok = c.placed_wrong = c.placed_unknown = 0;
    return;
  }
  // VMM: new physical memory on the target tier, staged at a scratch address,
  // filled by a copy, then swapped in under the same virtual address.
  driver::PhysicalMemory fresh(drv_, c.size, location(target));
  {
    driver::VaRange scratch(drv_, c.size, align_);
    driver::Mapping staged(drv_, scratch.base(), fresh, cfg_.device, target == Tier::Host, cfg_.host_node);
    CXL_CU(*drv_, cuMemcpy, scratch.base(), va, c.size);
  }  // scratch unmapped, its VA freed; `fresh` keeps the bytes
  // Unmap the old pages (still owned by c.phys); a failure here aborts the
  // migration with nothing changed.
  c.map.unmap();
  try {
    c.map = driver::Mapping(drv_, va, fresh, cfg_.device, target == Tier::Host, cfg_.host_node);
    grant_peers(va, c.size);
  } catch (...) {
    // Roll back: put the old pages back under the address.
    try {
      c.map = driver::Mapping(drv_, va, c.phys, cfg_.device, c.tier == Tier::Host, cfg_.host_node);
      grant_peers(va, c.size);
    } catch (const std::exception& e) {
      log_warning(std::string("migration rollback failed, the chunk is unmapped: ") + e.what());
    }
    throw;
  }
  c.phys = std::move(fresh);  // releases the old pages
  c.tier = target;
  c.touches = 0;
  if (target == Tier::Host) verify_host_placement(seg, c);
  else c.placed_ok = c.placed_wrong = c.placed_unknown = 0;
}

// ------------------------------------------------------------------ peer access
bool SegmentFactory::has_peer(int peer) const {
  if (peer == cfg_.device) return true;
  for (int p : peers_)
    if (p == peer) return true;
  return false;
}

bool SegmentFactory::add_peer(int peer) {
  if (has_peer(peer)) return false;
  peers_.push_back(peer);
  return true;
}

void SegmentFactory::grant_peers(CUdeviceptr va, size_t size) {
  if (peers_.empty()) return;
  std::vector<CUmemAccessDesc> desc(peers_.size());
  for (size_t i = 0; i < peers_.size(); ++i) {
    desc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc[i].location.id = peers_[i];
    desc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  CXL_CU(*drv_, cuMemSetAccess, va, size, static_cast<const CUmemAccessDesc*>(desc.data()), desc.size());
}

void SegmentFactory::grant_peer(const SegmentMemory& seg, int peer) {
  if (seg.backing != Backing::Vmm) return;  // managed and registered host memory: every device already
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = peer;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (const Chunk& c : seg.chunks)
    if (c.committed && c.map.va())
      CXL_CU(*drv_, cuMemSetAccess, c.map.va(), c.map.size(), static_cast<const CUmemAccessDesc*>(&desc), size_t(1));
}

}  // namespace cxl::backend
