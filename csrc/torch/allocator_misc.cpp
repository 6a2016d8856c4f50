// CxlAllocator: OOM observers, CUDA IPC, peer copies, cudagraph-tree
// checkpoints.
#include <c10/util/Exception.h>

#include "allocator.h"

namespace cxlt {

void CxlAllocator::attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lk(observers_mu_);
  oom_observers_.push_back(std::move(observer));
}

#if CXLT_TORCH_AT_LEAST(2, 13)
void CxlAllocator::attachOomRejectionObserver(CCA::OomRejectionObserver) {
  // Rejection observers hear about allocations refused *before* trying
  // (per-process memory fraction); cxlalloc never refuses preemptively, it
  // spills, so there is never anything to report.
}
#endif

CCA::ShareableHandle CxlAllocator::shareIpcHandle(void*) {
  TORCH_CHECK(false,
              "cxlalloc: sharing CUDA tensors between processes (CUDA IPC: torch.multiprocessing, "
              "Tensor.share_memory_, reductions) is not supported while cxlalloc is torch's allocator; "
              "copy the tensor to the CPU to share it, or run without cxlalloc");
}

std::shared_ptr<void> CxlAllocator::getIpcDevPtr(std::string) {
  TORCH_CHECK(false, "cxlalloc: opening CUDA IPC handles is not supported while cxlalloc is torch's allocator");
}

std::shared_ptr<CCA::AllocatorState> CxlAllocator::getCheckpointState(c10::DeviceIndex, c10::MempoolId_t) {
  TORCH_CHECK(false,
              "cxlalloc: torch.compile(mode=\"reduce-overhead\") CUDA graph trees need allocator checkpoints, "
              "which cxlalloc does not provide yet; use mode=\"max-autotune-no-cudagraphs\" or \"default\", "
              "or capture with torch.cuda.graph()/CUDAGraph directly (supported)");
}

CCA::CheckpointDelta CxlAllocator::setCheckpointPoolState(c10::DeviceIndex, std::shared_ptr<CCA::AllocatorState>) {
  TORCH_CHECK(false,
              "cxlalloc: torch.compile(mode=\"reduce-overhead\") CUDA graph trees need allocator checkpoints, "
              "which cxlalloc does not provide yet");
}

void CxlAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  // torch's own step (cudaDeviceEnablePeerAccess: plain device memory), then
  // cxlalloc's VMM mappings of `dev_to_access`, which only cuMemSetAccess
  // opens to `dev` (torch's expandable segments do the same, addPeer).
  Base::enablePeerAccess(dev, dev_to_access);
  if (c_.enable_peer_access(dev_to_access, dev) != 0) fail("enablePeerAccess");
}

cudaError_t CxlAllocator::memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                                      cudaStream_t stream, bool p2p_enabled) {
  // cxlalloc's device segments are VMM mappings (cuMemMap); without P2P
  // access a plain cudaMemcpyAsync between devices fails on such memory,
  // the peer variant works (torch's comment in CUDACachingAllocator.h).
  if (p2p_enabled || dst_device == src_device)
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
}

}  // namespace cxlt
