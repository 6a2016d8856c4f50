// The pure policy, exposed for direct unit tests (tests/engine/test_policy.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/error.h"
#include "policy/policy.h"
#include "python/bindings.h"

namespace py = pybind11;
using namespace cxl;
using namespace cxl::policy;

namespace cxl::python {

namespace {
TierBudget budget_from(const py::dict& d) {
  TierBudget b;
  for (auto item : d) {
    std::string k = py::cast<std::string>(item.first);
    size_t v = item.second.is_none() ? SIZE_MAX : py::cast<size_t>(item.second);
    if (k == "device_limit") b.device_limit = v;
    else if (k == "device_reserved") b.device_reserved = v;
    else if (k == "device_cached_free") b.device_cached_free = v;
    else if (k == "host_limit") b.host_limit = v;
    else if (k == "host_reserved") b.host_reserved = v;
    else if (k == "host_cached_free") b.host_cached_free = v;
    else if (k == "kv_device_quota") b.kv_device_quota = v;
    else if (k == "kv_device_bytes") b.kv_device_bytes = v;
    else if (k == "device_headroom") b.device_headroom = v;
    else throw Error(ErrorKind::InvalidArgument, "unknown budget field '" + k + "'");
  }
  return b;
}

std::vector<Candidate> cands_from(const py::list& l) {
  std::vector<Candidate> out;
  for (auto h : l) {
    auto t = py::cast<py::tuple>(h);  // (id, bytes, last_use, in_current_step)
    out.push_back({py::cast<uint64_t>(t[0]), py::cast<size_t>(t[1]), py::cast<uint64_t>(t[2]), py::cast<bool>(t[3])});
  }
  return out;
}
}  // namespace

void bind_policy(py::module_& m) {
  auto p = m.def_submodule("policy", "Pure placement/migration policy (csrc/policy/policy.h)");
  p.def("first_choice", [](const std::string& cls, size_t bytes, const py::dict& b, bool private_pool) {
    Request r{parse_class(cls), bytes, private_pool};
    return std::string(tier_name(first_choice(r, budget_from(b))));
  }, py::arg("cls"), py::arg("bytes"), py::arg("budget"), py::arg("private_pool") = false);
  p.def("may_spill", [](const std::string& cls, const py::dict& b, bool private_pool) {
    return may_spill(Request{parse_class(cls), 0, private_pool}, budget_from(b));
  }, py::arg("cls"), py::arg("budget"), py::arg("private_pool") = false);
  p.def("may_demote_for", [](const std::string& cls, bool private_pool) {
    return may_demote_for(Request{parse_class(cls), 0, private_pool});
  }, py::arg("cls"), py::arg("private_pool") = false);
  p.def("choose_victims", [](size_t need, const py::list& c, size_t budget) { return choose_victims(need, cands_from(c), budget); },
        py::arg("need"), py::arg("candidates"), py::arg("budget_bytes"));
  p.def("plan_extent_growth",
        [](size_t n, size_t chunk, const py::dict& b, const py::list& c, size_t budget, bool can_demote, bool host) {
          GrowthPlan g = plan_extent_growth(n, chunk, budget_from(b), cands_from(c), budget, can_demote, host);
          py::dict d;
          d["host_new"] = g.host_new;
          d["device_new"] = g.device_new;
          d["demote"] = g.demote;
          return d;
        },
        py::arg("new_chunks"), py::arg("chunk_bytes"), py::arg("budget"), py::arg("device_kv_chunks"),
        py::arg("budget_bytes"), py::arg("can_demote") = true, py::arg("may_use_host") = true);
  p.def("choose_promotions", [](const py::dict& b, const py::list& l, uint32_t min_touches, size_t budget) {
    std::vector<PromoteCandidate> c;
    for (auto h : l) {
      auto t = py::cast<py::tuple>(h);  // (id, bytes, last_use, touches, kv)
      c.push_back({py::cast<uint64_t>(t[0]), py::cast<size_t>(t[1]), py::cast<uint64_t>(t[2]), py::cast<uint32_t>(t[3]),
                   py::cast<bool>(t[4])});
    }
    return choose_promotions(budget_from(b), c, min_touches, budget);
  });
  py::class_<MigrationBudget>(p, "MigrationBudget")
      .def(py::init<double, size_t>(), py::arg("rate_bytes_per_s"), py::arg("burst_bytes"))
      .def("available", &MigrationBudget::available, py::arg("now_s"))
      .def("consume", &MigrationBudget::consume, py::arg("bytes"), py::arg("now_s"));
}

}  // namespace cxl::python
