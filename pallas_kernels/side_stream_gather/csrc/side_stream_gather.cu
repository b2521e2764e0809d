// Shared-index prefetch on a CUDA stream of its own (issue 10 item 3), as two XLA FFI calls.
//
// XLA runs a program's kernels on one compute stream, and its stream annotation did not overlap
// a side-stream call with anything on JAX 0.11.2 (docs/architecture.md, "Overlap"). Here the
// ordering is ours:
//
//   hisparse_side_gather_start  (pool, layer, host_slots, counts, tie) -> (rows, tie)
//     records an event on the compute stream (the plan is ready), makes this device's side
//     stream wait for it, launches the row gather there, and records a per-tag "done" event.
//     It returns at once: the compute stream goes on with the kernels after it.
//   hisparse_side_gather_wait   (rows, pool, layer, host_slots, counts, tie) -> tie
//     makes the compute stream wait for that tag's done event. Nothing is copied. The caller
//     reads rows only through an optimization barrier with the returned tie, so after the wait.
//
// `tie` is a pass-through (the output aliases the operand): the caller threads a value the
// following compute needs through each call, so XLA issues the start before that compute and
// the wait after it. The wait takes the start's operands again so XLA keeps their buffers
// alive (and the pool unwritten) until the side stream is done reading them.
//
// The gather: rows[r, i, :] = pool[layer, host_slots[r, i], :] for i < counts[r]; rows past
// counts[r] are left as they are (callers read the first counts[r]). The pool is pinned host
// memory read through unified addressing; one warp per row, 16-byte loads.

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "side_stream_gather.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

template <typename Vec>
__global__ void GatherRowsKernel(const char* __restrict__ pool, const int32_t* __restrict__ layer,
                                 const int32_t* __restrict__ host_slots, const int32_t* __restrict__ counts,
                                 char* __restrict__ rows, int64_t num_requests, int64_t max_rows,
                                 int64_t num_layers, int64_t pool_slots, int64_t row_bytes) {
  if (layer[0] < 0 || layer[0] >= num_layers) return;  // a bad layer: read nothing
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const char* layer_base = pool + static_cast<int64_t>(layer[0]) * pool_slots * row_bytes;
  for (int64_t g = warp; g < num_requests * max_rows; g += warps) {
    const int64_t r = g / max_rows;
    const int64_t i = g - r * max_rows;
    if (i >= counts[r]) continue;
    const int64_t slot = host_slots[g];
    if (slot < 0 || slot >= pool_slots) continue;  // a bad plan entry: leave the row, read nothing
    const Vec* src = reinterpret_cast<const Vec*>(layer_base + slot * row_bytes);
    Vec* dst = reinterpret_cast<Vec*>(rows + g * row_bytes);
    for (int64_t v = lane; v < vecs; v += 32) dst[v] = src[v];
  }
}

// One side stream per device, and the events that order it against the compute stream.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;                       // recorded on the compute stream by a start
  std::unordered_map<int64_t, cudaEvent_t> done;  // tag -> recorded on the side stream
};

std::mutex side_streams_mutex;
std::unordered_map<int, SideStream> side_streams;  // device ordinal -> its side stream

ffi::Error CudaError(cudaError_t status, const char* what) {
  return ffi::Error::Internal(std::string("hisparse side-stream gather: ") + what + ": " + cudaGetErrorString(status));
}

ffi::ErrorOr<SideStream*> SideStreamFor(int device) {
  std::lock_guard<std::mutex> lock(side_streams_mutex);
  SideStream& side = side_streams[device];
  if (side.stream == nullptr) {
    cudaError_t status = cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking);
    if (status != cudaSuccess) return CudaError(status, "cudaStreamCreate");
    status = cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming);
    if (status != cudaSuccess) return CudaError(status, "cudaEventCreate");
  }
  return &side;
}

ffi::ErrorOr<cudaEvent_t> DoneEvent(SideStream* side, int64_t tag, bool create) {
  std::lock_guard<std::mutex> lock(side_streams_mutex);
  auto it = side->done.find(tag);
  if (it != side->done.end()) return it->second;
  if (!create) return ffi::Error::Internal("hisparse side-stream gather: wait for tag " + std::to_string(tag) + " before any start");
  cudaEvent_t event;
  cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (status != cudaSuccess) return CudaError(status, "cudaEventCreate");
  side->done[tag] = event;
  return event;
}

// The pass-through: XLA aliases tie_out to tie, so this copies nothing; were it ever not to,
// the value still comes through (on the compute stream, in order).
ffi::Error PassThrough(cudaStream_t compute, const ffi::AnyBuffer& tie, ffi::Result<ffi::AnyBuffer>& tie_out) {
  if (tie_out->untyped_data() == tie.untyped_data()) return ffi::Error::Success();
  cudaError_t status = cudaMemcpyAsync(tie_out->untyped_data(), tie.untyped_data(), tie.size_bytes(), cudaMemcpyDeviceToDevice, compute);
  return status == cudaSuccess ? ffi::Error::Success() : CudaError(status, "pass-through copy");
}

ffi::Error GatherStart(cudaStream_t compute, int32_t device, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> host_slots, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer tie,
                       ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> tie_out,
                       int64_t tag, int64_t blocks, int64_t threads) {
  auto pool_dims = pool.dimensions();  // [L, S, W]
  auto slot_dims = host_slots.dimensions();  // [R, K]
  if (pool_dims.size() != 3 || slot_dims.size() != 2) return ffi::Error::InvalidArgument("hisparse side-stream gather: pool must be [L, S, W], host_slots [R, K]");
  const int64_t row_bytes = pool_dims[2] * static_cast<int64_t>(ffi::ByteWidth(pool.element_type()));
  if (row_bytes % 4 != 0) return ffi::Error::InvalidArgument("hisparse side-stream gather: row bytes must be a multiple of 4");
  cudaError_t status = cudaSetDevice(device);
  if (status != cudaSuccess) return CudaError(status, "cudaSetDevice");
  auto side = SideStreamFor(device);
  if (side.has_error()) return side.error();
  auto done = DoneEvent(*side, tag, /*create=*/true);
  if (done.has_error()) return done.error();
  // The plan (and everything else before this call) is on the compute stream: fork from it.
  if ((status = cudaEventRecord((*side)->fork, compute)) != cudaSuccess) return CudaError(status, "record fork");
  if ((status = cudaStreamWaitEvent((*side)->stream, (*side)->fork, 0)) != cudaSuccess) return CudaError(status, "side waits fork");
  const auto* pool_ptr = static_cast<const char*>(pool.untyped_data());
  auto* rows_ptr = static_cast<char*>(rows->untyped_data());
  if (row_bytes % 16 == 0) {
    GatherRowsKernel<uint4><<<blocks, threads, 0, (*side)->stream>>>(pool_ptr, layer.typed_data(), host_slots.typed_data(), counts.typed_data(), rows_ptr,
                                                                    slot_dims[0], slot_dims[1], pool_dims[0], pool_dims[1], row_bytes);
  } else {
    GatherRowsKernel<uint32_t><<<blocks, threads, 0, (*side)->stream>>>(pool_ptr, layer.typed_data(), host_slots.typed_data(), counts.typed_data(), rows_ptr,
                                                                       slot_dims[0], slot_dims[1], pool_dims[0], pool_dims[1], row_bytes);
  }
  if ((status = cudaGetLastError()) != cudaSuccess) return CudaError(status, "launch");
  if ((status = cudaEventRecord(*done, (*side)->stream)) != cudaSuccess) return CudaError(status, "record done");
  return PassThrough(compute, tie, tie_out);
}

ffi::Error GatherWait(cudaStream_t compute, int32_t device, ffi::AnyBuffer /*rows*/, ffi::AnyBuffer /*pool*/,
                      ffi::AnyBuffer /*layer*/, ffi::AnyBuffer /*host_slots*/, ffi::AnyBuffer /*counts*/, ffi::AnyBuffer tie,
                      ffi::Result<ffi::AnyBuffer> tie_out, int64_t tag) {
  auto side = SideStreamFor(device);
  if (side.has_error()) return side.error();
  auto done = DoneEvent(*side, tag, /*create=*/false);
  if (done.has_error()) return done.error();
  cudaError_t status = cudaStreamWaitEvent(compute, *done, 0);
  if (status != cudaSuccess) return CudaError(status, "compute waits done");
  return PassThrough(compute, tie, tie_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSideGatherStart, GatherStart,
                              hisparse::GatherStartSignature(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSideGatherWait, GatherWait,
                              hisparse::GatherWaitSignature(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()));
