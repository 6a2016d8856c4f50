#include "alloc/segment.h"

#include "alloc/block.h"

namespace cxl::alloc {

bool Segment::fully_free() const {
  return !extent && head != nullptr && !head->allocated && head->event_count == 0 && head->next == nullptr &&
         head->size == size;
}

}  // namespace cxl::alloc
