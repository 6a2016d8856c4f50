#include "alloc/class_scope.h"

#include <vector>

#include "common/error.h"

namespace cxl::alloc {

namespace {
thread_local std::vector<AllocClass> t_stack;
}

void push_class(AllocClass c) { t_stack.push_back(c); }

void pop_class() {
  CXL_CHECK(!t_stack.empty(), "class scope popped more often than pushed");
  t_stack.pop_back();
}

AllocClass current_class() { return t_stack.empty() ? AllocClass::Other : t_stack.back(); }

}  // namespace cxl::alloc
