#include "alloc/segment.h"

#include "alloc/block.h"

namespace cxl::alloc {

bool Segment::fully_free() const {
  return !extent && head != nullptr && !head->allocated && head->event_count == 0 && head->next == nullptr &&
         head->size == size;
}

bool Segment::has_event_pending_frees() const {
  for (const Block* b = head; b; b = b->next)
    if (!b->allocated && b->event_count > 0) return true;
  return false;
}

}  // namespace cxl::alloc
