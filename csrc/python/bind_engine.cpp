// Python bindings of the engine: _C.Engine, _C.DeviceAllocator, extents,
// DLPack export, and the process-wide current engine.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <set>

#include "alloc/class_scope.h"
#include "alloc/engine.h"
#include "common/error.h"
#include "common/log.h"
#include "python/bindings.h"
#include "python/convert.h"

namespace py = pybind11;
using namespace cxl;
using namespace cxl::alloc;

namespace cxl::python {

namespace {

// A device allocator as seen from Python: keeps its engine alive.
struct DeviceHandle {
  std::shared_ptr<Engine> engine;
  DeviceAllocator* a;
};

// An extent owned jointly by its Python object and every tensor viewing it.
struct ExtentHandle {
  std::shared_ptr<Engine> engine;
  DeviceAllocator* a;
  ExtentInfo info;
  // Lengths of the live views (DLPack exports) of this extent.  A view
  // covers committed bytes only, and a trim never releases a chunk under a
  // live view: reading any view can never fault.  Deleters run on any thread.
  std::mutex views_mu;
  std::multiset<size_t> views;
  size_t longest_view() {
    std::lock_guard<std::mutex> lk(views_mu);
    return views.empty() ? 0 : *views.rbegin();
  }
  ~ExtentHandle() { a->extent_free_or_park(info.id); }  // never throws: parks the extent if the release fails
};

struct DLContext {
  std::shared_ptr<Engine> engine;       // keeps the allocator alive
  DeviceAllocator* a = nullptr;
  void* block = nullptr;                // owned block, freed by the deleter
  std::shared_ptr<ExtentHandle> extent; // or a share of an extent
  size_t view_bytes = 0;                // the extent bytes this view covers
  int64_t shape[1];
  int64_t strides[1];
};

void dl_deleter(DLManagedTensor* self) {
  auto* ctx = static_cast<DLContext*>(self->manager_ctx);
  if (ctx->block) {
    ctx->a->free_owned_or_park(ctx->block);  // never throws: parks the block if the free fails
  }
  if (ctx->extent) {
    std::lock_guard<std::mutex> lk(ctx->extent->views_mu);
    auto it = ctx->extent->views.find(ctx->view_bytes);
    if (it != ctx->extent->views.end()) ctx->extent->views.erase(it);
  }
  delete ctx;
  delete self;
}

py::capsule make_capsule(DLContext* ctx, uint64_t ptr, size_t nbytes, int device_type, int device_id) {
  return byte_capsule(reinterpret_cast<void*>(ptr), nbytes, DLDevice{device_type, device_id},
                      ctx, ctx->shape, ctx->strides, dl_deleter);
}

// torch.cuda.memory_stats()-style flat keys for the device tier.
py::dict torch_flat(const TorchStats& t) {
  py::dict d;
  const char* pools[3] = {"all", "small_pool", "large_pool"};
  auto put = [&](const char* name, const Stat* arr) {
    for (int i = 0; i < 3; ++i) {
      std::string base = std::string(name) + "." + pools[i] + ".";
      d[py::str(base + "current")] = arr[i].current;
      d[py::str(base + "peak")] = arr[i].peak;
      d[py::str(base + "allocated")] = arr[i].allocated;
      d[py::str(base + "freed")] = arr[i].freed;
    }
  };
  put("allocation", t.allocation);
  put("segment", t.segment);
  put("active", t.active);
  put("inactive_split", t.inactive_split);
  put("allocated_bytes", t.allocated_bytes);
  put("reserved_bytes", t.reserved_bytes);
  put("active_bytes", t.active_bytes);
  put("inactive_split_bytes", t.inactive_split_bytes);
  put("requested_bytes", t.requested_bytes);
  d["num_alloc_retries"] = t.num_alloc_retries;
  d["num_ooms"] = t.num_ooms;
  d["num_sync_all_streams"] = t.num_sync_all_streams;
  d["num_device_alloc"] = t.num_device_alloc;
  d["num_device_free"] = t.num_device_free;
  return d;
}

py::dict stats_dict(DeviceAllocator& a) {
  Stats s = a.stats();
  const auto& cfg = a.config();
  auto placement = a.placement();
  py::dict out;
  py::dict dev, host;
  auto tier = [&](py::dict& d, const TierStats& t) {
    d["allocated_bytes"] = t.allocated_bytes.current;
    d["reserved_bytes"] = t.reserved_bytes.current;
    d["peak_allocated_bytes"] = t.allocated_bytes.peak;
    d["peak_reserved_bytes"] = t.reserved_bytes.peak;
    d["segments"] = t.segments.current;
  };
  tier(dev, s.tier[0]);
  tier(host, s.tier[1]);
  dev["limit_bytes"] = cfg.device_limit;
  dev["device"] = cfg.device;
  host["limit_bytes"] = a.host_backend_name() == "none" ? size_t(0) : cfg.host_limit;
  host["numa_node"] = cfg.host_node;
  host["backend"] = a.host_backend_name();
  py::dict pl;
  pl["verified_bytes"] = placement.ok;
  pl["misplaced_bytes"] = placement.wrong;
  pl["unverified_bytes"] = placement.unknown;
  pl["method"] = placement.method;
  host["placement"] = pl;
  out["device"] = dev;
  out["host"] = host;
  for (int c = 0; c < kNumClasses; ++c) {
    py::dict d;
    d["device_bytes"] = s.class_bytes[c][0].current;
    d["host_bytes"] = s.class_bytes[c][1].current;
    d["peak_device_bytes"] = s.class_bytes[c][0].peak;
    d["peak_host_bytes"] = s.class_bytes[c][1].peak;
    out[class_name(static_cast<AllocClass>(c))] = d;
  }
  const Counters& k = s.counters;
  out["allocations"] = k.allocations;
  out["frees"] = k.frees;
  out["spilled_bytes"] = k.spilled_bytes;
  out["spilled_allocations"] = k.spilled_allocations;
  out["demoted_bytes"] = k.demoted_bytes;
  out["demotions"] = k.demotions;
  out["promoted_bytes"] = k.promoted_bytes;
  out["promotions"] = k.promotions;
  out["reclaimed_bytes"] = k.reclaimed_bytes;
  out["event_drains"] = k.event_drains;
  out["cache_hits"] = k.cache_hits;
  out["new_device_segments"] = k.new_segments[0];
  out["new_host_segments"] = k.new_segments[1];
  out["released_device_segments"] = k.released_segments[0];
  out["released_host_segments"] = k.released_segments[1];
  out["driver_refused_device_segments"] = k.driver_refused_segments[0];
  out["driver_refused_host_segments"] = k.driver_refused_segments[1];
  out["invalid_frees"] = k.invalid_frees;
  out["ooms"] = k.ooms;
  out["capture_refusals"] = k.capture_refusals;
  out["migration_budget_denials"] = k.migration_budget_denials;
  out["event_record_failures"] = k.event_record_failures;
  out["deferred_moves"] = k.deferred_moves;
  out["deferred_moves_done"] = k.deferred_moves_done;
  out["parked_frees"] = a.parked_frees();
  out["parked_extents"] = a.parked_extents();
  out["queued_moves"] = a.deferred_moves();
  out["deferred_move_failures"] = k.deferred_move_failures;
  out["torch"] = torch_flat(s.torch);
  return out;
}

AllocatorConfig config_from(const py::dict& d) {
  AllocatorConfig c;
  for (auto item : d) {
    std::string k = py::cast<std::string>(item.first);
    py::handle v = item.second;
    if (k == "device_limit") c.device_limit = py::cast<size_t>(v);
    else if (k == "host_limit") c.host_limit = py::cast<size_t>(v);
    else if (k == "host_node") c.host_node = py::cast<int>(v);
    else if (k == "backend") c.backend = backend::parse_host_backend(py::cast<std::string>(v));
    else if (k == "kv_device_limit") c.kv_device_limit = v.is_none() ? SIZE_MAX : py::cast<size_t>(v);
    else if (k == "device_headroom") c.device_headroom = py::cast<size_t>(v);
    else if (k == "migration_rate") c.migration_rate = py::cast<double>(v);
    else if (k == "migration_burst") c.migration_burst = py::cast<size_t>(v);
    else if (k == "promote_after") c.promote_after = py::cast<uint32_t>(v);
    else if (k == "extent_chunk") c.extent_chunk = py::cast<size_t>(v);
    else if (k == "strict_placement") c.strict_placement = py::cast<bool>(v);
    else if (k == "check_capture") c.check_capture = py::cast<bool>(v);
    else if (k == "kv_aware") c.kv_aware = py::cast<bool>(v);
    else if (k == "oom_hint") c.oom_hint = py::cast<std::string>(v);
    else if (k == "host_node_free_bytes") c.host_node_free_bytes = py::cast<size_t>(v);
    else if (k == "implicit_moves_any_thread") c.implicit_moves_any_thread = py::cast<bool>(v);
    else
      throw Error(ErrorKind::InvalidArgument, "unknown allocator option '" + k + "'");
  }
  return c;
}

Tier parse_tier(const std::string& s) {
  if (s == "device") return Tier::Device;
  if (s == "host") return Tier::Host;
  throw Error(ErrorKind::InvalidArgument, "tier: '" + s + "' is not a tier; allowed: device, host");
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine",
                                              "A loaded CUDA driver (real or simulated) and one allocator per GPU.")
      .def(py::init<const std::string&, bool>(), py::arg("driver_path"), py::arg("simulated"))
      .def_property_readonly("device_count", &Engine::device_count)
      .def_property_readonly("driver_version", [](Engine& e) { return e.driver()->version(); })
      .def_property_readonly("simulated", [](Engine& e) { return e.driver()->simulated(); })
      .def_property_readonly("numa_method", [](Engine& e) { return e.numa() ? e.numa()->method() : std::string("none"); })
      .def("configure_device",
           [](Engine& e, int d, const py::dict& cfg) { e.configure_device(d, config_from(cfg)); },
           py::arg("device"), py::arg("config"))
      .def("has_config", &Engine::has_config)
      .def("mem_info", &Engine::mem_info, py::arg("device"), "(free, total) VRAM bytes of the device now.")
      .def("attribute", &Engine::attribute, py::arg("device"), py::arg("attr"), py::arg("fallback") = -1)
      .def("device_name", &Engine::device_name, py::arg("device"))
      .def(
          "device",
          [](std::shared_ptr<Engine> e, int d) {
            DeviceAllocator* a;
            {
              py::gil_scoped_release nogil;
              a = &e->device(d);
            }
            return DeviceHandle{e, a};
          },
          py::arg("device"))
      .def("existing", [](std::shared_ptr<Engine> e, int d) -> py::object {
        DeviceAllocator* a = e->existing(d);
        if (!a) return py::none();
        return py::cast(DeviceHandle{e, a});
      });

  m.def("set_current_engine", [](std::shared_ptr<Engine> e) { Engine::set_current(std::move(e)); },
        py::arg("engine").none(true), "Make `engine` the one the C ABI (torch's allocator hooks) serves from.");
  m.def("current_engine", []() { return Engine::current(); });
  m.def("push_class", [](const std::string& c) { push_class(parse_class(c)); });
  m.def("pop_class", []() { pop_class(); });
  m.def("current_class", []() { return std::string(class_name(current_class())); });

  py::class_<ExtentHandle, std::shared_ptr<ExtentHandle>>(m, "ExtentHandle")
      .def_property_readonly("id", [](ExtentHandle& h) { return h.info.id; })
      .def_property_readonly("base", [](ExtentHandle& h) { return h.info.base; })
      .def_property_readonly("capacity", [](ExtentHandle& h) { return h.info.capacity; })
      .def_property_readonly("chunk_bytes", [](ExtentHandle& h) { return h.info.chunk_bytes; })
      .def_property_readonly("lazy", [](ExtentHandle& h) { return h.info.lazy; })
      .def_property_readonly("committed", [](ExtentHandle& h) { return h.a->extent_committed(h.info.id); })
      .def("grow", [](ExtentHandle& h, size_t n) {
        py::gil_scoped_release nogil;
        h.a->extent_grow(h.info.id, n);
      })
      .def("trim", [](ExtentHandle& h, size_t n) {
        py::gil_scoped_release nogil;
        // Chunks under a live view stay committed (released by a later trim
        // once the view is gone): a view never covers unmapped memory.
        h.a->extent_trim(h.info.id, std::max(n, h.longest_view()));
      })
      .def("touch", [](ExtentHandle& h) { h.a->extent_touch(h.info.id); })
      .def("tiers", [](ExtentHandle& h) {
        py::list out;
        for (const auto& r : h.a->extent_tiers(h.info.id)) out.append(py::make_tuple(r.offset, r.length, r.tier));
        return out;
      })
      .def(
          "dlpack",
          [](std::shared_ptr<ExtentHandle> h, int device_type, int device_id) {
            // The committed prefix only: bytes beyond it have no memory
            // mapped, and a read there faults (on a GPU: kills the context).
            size_t n = h->a->extent_committed_prefix(h->info.id);
            auto ctx = std::make_unique<DLContext>();
            ctx->engine = h->engine;
            ctx->a = h->a;
            ctx->extent = h;
            ctx->view_bytes = n;
            {
              std::lock_guard<std::mutex> lk(h->views_mu);
              h->views.insert(n);
            }
            return make_capsule(ctx.release(), h->info.base, n, device_type, device_id);
          },
          py::arg("device_type"), py::arg("device_id"),
          "A DLPack capsule viewing the extent's committed prefix as uint8[committed]; it keeps the extent "
          "alive, and chunks under it committed.");

  py::class_<DeviceHandle>(m, "DeviceAllocator", "The tiered caching allocator of one GPU.")
      .def_property_readonly("device", [](DeviceHandle& h) { return h.a->device(); })
      .def(
          "malloc",
          [](DeviceHandle& h, size_t n, uint64_t stream, const std::string& cls, bool only_host) {
            AllocClass c = parse_class(cls);
            py::gil_scoped_release nogil;
            h.a->check_stream(reinterpret_cast<CUstream>(stream));
            return reinterpret_cast<uint64_t>(h.a->malloc(n, reinterpret_cast<CUstream>(stream), c, only_host));
          },
          py::arg("nbytes"), py::arg("stream") = 0, py::arg("tag") = "other", py::arg("only_host") = false)
      .def(
          "free",
          [](DeviceHandle& h, uint64_t p) {
            py::gil_scoped_release nogil;
            h.a->free(reinterpret_cast<void*>(p));
          },
          py::arg("ptr"))
      .def("record_stream", [](DeviceHandle& h, uint64_t p, uint64_t s) {
        h.a->check_stream(reinterpret_cast<CUstream>(s));
        h.a->record_stream(reinterpret_cast<void*>(p), reinterpret_cast<CUstream>(s));
      })
      .def("empty_cache", [](DeviceHandle& h) {
        py::gil_scoped_release nogil;
        return h.a->empty_cache();
      })
      .def("allocation_size", [](DeviceHandle& h, uint64_t p) { return h.a->allocation_size(reinterpret_cast<void*>(p)); })
      .def("tier_of", [](DeviceHandle& h, uint64_t p) { return std::string(tier_name(h.a->tier_of(reinterpret_cast<void*>(p)))); })
      .def(
          "migrate",
          [](DeviceHandle& h, uint64_t p, size_t len, const std::string& t) {
            Tier tier = parse_tier(t);
            py::gil_scoped_release nogil;
            return h.a->migrate(reinterpret_cast<void*>(p), len, tier);
          },
          py::arg("ptr"), py::arg("length"), py::arg("tier"))
      .def("rebalance", [](DeviceHandle& h) {
        py::gil_scoped_release nogil;
        return h.a->rebalance();
      })
      .def("mark_step", [](DeviceHandle& h) { h.a->mark_step(); })
      .def("set_external_device_bytes", [](DeviceHandle& h, size_t n) { h.a->set_external_device_bytes(n); })
      .def(
          "extent",
          [](DeviceHandle& h, size_t capacity, const std::string& cls) {
            AllocClass c = parse_class(cls);
            ExtentInfo info;
            {
              py::gil_scoped_release nogil;
              info = h.a->extent_create(capacity, c);
            }
            auto e = std::make_shared<ExtentHandle>();
            e->engine = h.engine;
            e->a = h.a;
            e->info = info;
            return e;
          },
          py::arg("capacity"), py::arg("tag") = "kv")
      .def(
          "dlpack",
          [](DeviceHandle& h, uint64_t p, size_t nbytes, int device_type, int device_id) {
            void* block = reinterpret_cast<void*>(p);
            h.a->adopt(block);  // from here only the capsule's deleter may free it
            DLContext* ctx = nullptr;
            try {
              ctx = new DLContext();
            } catch (...) {
              h.a->free_owned(block);
              throw;
            }
            ctx->engine = h.engine;
            ctx->a = h.a;
            ctx->block = block;
            return make_capsule(ctx, p, nbytes, device_type, device_id);  // frees the block if it fails
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("device_type"), py::arg("device_id"),
          "A DLPack capsule that takes ownership of the live block at `ptr`: freed when the tensor dies, or at "
          "once if the capsule cannot be made; a plain free() of `ptr` is refused from then on.")
      .def("stats", [](DeviceHandle& h) { return stats_dict(*h.a); })
      .def("reset_peak_stats", [](DeviceHandle& h) { h.a->reset_peak_stats(); })
      .def("reset_accumulated_stats", [](DeviceHandle& h) { h.a->reset_accumulated_stats(); })
      .def("check_invariants", [](DeviceHandle& h) { h.a->check_invariants(); })
      .def("describe_tiers", [](DeviceHandle& h) { return h.a->describe_tiers(); })
      .def("snapshot", [](DeviceHandle& h) {
        py::list out;
        for (const auto& s : h.a->snapshot()) {
          py::dict d;
          d["id"] = s.id;
          d["base"] = s.base;
          d["size"] = s.size;
          d["allocated"] = s.allocated;
          d["tier"] = s.tier;
          d["class"] = s.cls;
          d["backing"] = s.backing;
          d["kind"] = s.kind;
          d["stream"] = s.stream;
          d["pool"] = py::make_tuple(s.pool.a, s.pool.b);
          d["device_bytes"] = s.device_bytes;
          d["host_bytes"] = s.host_bytes;
          d["extent"] = s.extent;
          py::list blocks;
          for (const auto& b : s.blocks) {
            py::dict bd;
            bd["ptr"] = b.ptr;
            bd["size"] = b.size;
            bd["requested"] = b.requested;
            bd["allocated"] = b.allocated;
            bd["pending_events"] = b.pending_events;
            blocks.append(bd);
          }
          d["blocks"] = blocks;
          out.append(d);
        }
        return out;
      })
      .def("info", [](DeviceHandle& h) {
        const auto& f = h.a->facts();
        const auto& c = h.a->config();
        py::dict d;
        d["device"] = c.device;
        d["device_limit"] = c.device_limit;
        d["host_limit"] = c.host_limit;
        d["host_node"] = c.host_node;
        d["backend"] = h.a->host_backend_name();
        d["demotion_supported"] = h.a->demotion_supported();
        d["kv_device_limit"] = c.kv_device_limit == SIZE_MAX ? py::object(py::none()) : py::cast(c.kv_device_limit);
        d["device_headroom"] = c.device_headroom;
        d["policy"] = c.kv_aware ? "kv-aware" : "first-fit";
        d["total_bytes"] = f.total_bytes;
        d["free_bytes_at_start"] = f.free_bytes;
        d["device_granularity"] = f.device_granularity;
        d["host_granularity"] = f.host_granularity;
        py::dict sup;
        for (const auto& [name, s] : h.a->backend_support()) sup[py::str(name)] = py::make_tuple(s.ok, s.reason);
        d["backend_support"] = sup;
        return d;
      });
}

}  // namespace cxl::python
