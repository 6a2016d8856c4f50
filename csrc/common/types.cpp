#include "common/types.h"

#include "common/error.h"

namespace cxl {

const char* tier_name(Tier t) { return t == Tier::Device ? "device" : "host"; }

const char* class_name(AllocClass c) {
  switch (c) {
    case AllocClass::KV: return "kv";
    case AllocClass::Weight: return "weight";
    default: return "other";
  }
}

AllocClass parse_class(const std::string& s, const char* option) {
  if (s == "kv") return AllocClass::KV;
  if (s == "weight") return AllocClass::Weight;
  if (s == "other") return AllocClass::Other;
  throw Error(ErrorKind::InvalidArgument,
              std::string(option) + ": '" + s + "' is not a valid allocation class; allowed: kv, weight, other");
}

}  // namespace cxl
