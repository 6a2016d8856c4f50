// Which backend serves each tier of one device: every backend's support on
// this GPU and node, the host tier's backend (the one asked for, or the
// first that works), and the SegmentFactory configuration that follows.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "backend/backends.h"
#include "backend/segment_factory.h"
#include "driver/resources.h"

namespace cxl::backend {

struct SelectionRequest {
  int device = 0;
  int host_node = 0;
  bool host_enabled = false;           // a host tier is wanted (host_limit > 0)
  std::optional<HostBackend> backend;  // nullopt: choose (host-vmm > managed > pinned)
  bool strict_placement = false;
};

struct Selection {
  DeviceFacts facts;
  // "device", "host-vmm", "managed", "pinned" -> (ok, reason).
  std::map<std::string, Support> support;
  FactoryConfig factory;
};

// Needs the device's primary context current (probes allocate one granule).
// Throws Error(Unavailable) when a host tier is wanted and the backend asked
// for, or with none asked for every backend, cannot be used; the message
// lists each backend's support.
Selection select_backends(const driver::DriverPtr& drv, const SelectionRequest& req);

}  // namespace cxl::backend
