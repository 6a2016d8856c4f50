// The allocation class of the calling thread: `with cxlalloc.kv():` pushes
// KV, `with cxlalloc.weights():` pushes Weight.  Thread-local because torch's
// allocator is called on the thread that creates the tensor, and scopes of
// different threads must not leak into each other.
#pragma once

#include "common/types.h"

namespace cxl::alloc {

void push_class(AllocClass c);
// Throws Internal on an unbalanced pop.
void pop_class();
AllocClass current_class();

}  // namespace cxl::alloc
