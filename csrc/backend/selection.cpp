#include "backend/selection.h"

#include "common/error.h"
#include "common/units.h"

namespace cxl::backend {

namespace {
// Segment alignment when the driver reports no VMM granularity (cuMemAlloc
// has none): the block cache's large-segment rounding (kLargeSegmentRound,
// alloc/sizes.h).
constexpr size_t kFallbackGranularity = 2 * MiB;
}  // namespace

Selection select_backends(const driver::DriverPtr& drv, const SelectionRequest& req) {
  Selection out;
  out.facts = read_device_facts(*drv, req.device, req.host_node);
  const DeviceFacts& facts = out.facts;
  auto& support = out.support;

  Support dev = device_vmm_support(facts);
  support["device"] = dev.ok ? dev : Support{true, "no VMM (" + dev.reason + "): cuMemAlloc segments, no demotion"};
  for (int i = 0; i < kNumHostBackends; ++i) {
    auto b = static_cast<HostBackend>(i);
    Support s = host_support(b, facts);
    if (s.ok && b == HostBackend::HostVmm) s = probe_host_vmm(drv, req.host_node, facts.host_granularity);
    support[host_backend_name(b)] = s;
  }

  HostBackend chosen = req.backend.value_or(HostBackend::HostVmm);
  if (req.host_enabled) {
    auto supported_list = [&] {
      std::string list;
      for (int i = 0; i < kNumHostBackends; ++i) {
        auto b = static_cast<HostBackend>(i);
        const auto& s = support[host_backend_name(b)];
        list += std::string(list.empty() ? "" : "; ") + host_backend_name(b) + ": " + (s.ok ? "supported" : s.reason);
      }
      return list;
    };
    if (req.backend) {
      const auto& s = support[host_backend_name(chosen)];
      if (!s.ok)
        throw Error(ErrorKind::Unavailable, std::string("backend: '") + host_backend_name(chosen) +
                                                "' cannot be used on cuda:" + std::to_string(req.device) + ": " +
                                                s.reason + " (" + supported_list() + ")");
    } else {
      // Default order, pending measurement on a real GPU (README, "Backends"):
      // host-vmm is pinned (no page faults) and remappable (demotion keeps
      // the address); managed migrates by prefetch but faults; pinned cannot
      // move pages between tiers.
      bool found = false;
      for (HostBackend b : {HostBackend::HostVmm, HostBackend::Managed, HostBackend::Pinned}) {
        if (support[host_backend_name(b)].ok) {
          chosen = b;
          found = true;
          break;
        }
      }
      if (!found)
        throw Error(ErrorKind::Unavailable, "no host-tier backend works on cuda:" + std::to_string(req.device) +
                                                " (" + supported_list() +
                                                "); set host_limit=0 to run without a host tier");
    }
  }

  FactoryConfig& fc = out.factory;
  fc.device = req.device;
  fc.host_node = req.host_node;
  fc.host_backend = chosen;
  fc.host_enabled = req.host_enabled;
  fc.device_vmm = dev.ok;
  fc.device_granularity = facts.device_granularity ? facts.device_granularity : kFallbackGranularity;
  fc.host_granularity = (chosen == HostBackend::HostVmm && facts.host_granularity) ? facts.host_granularity
                                                                                 : fc.device_granularity;
  fc.strict_placement = req.strict_placement;
  return out;
}

}  // namespace cxl::backend
