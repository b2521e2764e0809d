// The CPU version of side_stream_gather.cu's two FFI targets, so the decode step's wiring of
// the side-stream prefetch runs in CPU tests: the start gathers in line (there is no second
// stream), the wait does nothing. Same operands, results and attributes as the CUDA version.

#include <cstdint>
#include <cstring>

#include "side_stream_gather.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The pass-through (aliased by XLA, so normally nothing to copy), as the CUDA version's.
void PassThrough(const ffi::AnyBuffer& tie, ffi::Result<ffi::AnyBuffer>& tie_out) {
  if (tie_out->untyped_data() != tie.untyped_data()) std::memcpy(tie_out->untyped_data(), tie.untyped_data(), tie.size_bytes());
}

ffi::Error GatherStart(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> host_slots,
                       ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer tie, ffi::Result<ffi::AnyBuffer> rows,
                       ffi::Result<ffi::AnyBuffer> tie_out, int64_t /*tag*/, int64_t /*blocks*/,
                       int64_t /*threads*/) {
  PassThrough(tie, tie_out);
  auto pool_dims = pool.dimensions();        // [L, S, W]
  auto slot_dims = host_slots.dimensions();  // [R, K]
  if (pool_dims.size() != 3 || slot_dims.size() != 2) return ffi::Error::InvalidArgument("hisparse side-stream gather: pool must be [L, S, W], host_slots [R, K]");
  const int64_t row_bytes = pool_dims[2] * static_cast<int64_t>(ffi::ByteWidth(pool.element_type()));
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= pool_dims[0]) return ffi::Error::Success();  // a bad layer: read nothing (as the GPU)
  const char* base = static_cast<const char*>(pool.untyped_data()) + l * pool_dims[1] * row_bytes;
  char* out = static_cast<char*>(rows->untyped_data());
  for (int64_t r = 0; r < slot_dims[0]; ++r) {
    for (int64_t i = 0; i < counts.typed_data()[r] && i < slot_dims[1]; ++i) {
      const int64_t g = r * slot_dims[1] + i;
      const int64_t slot = host_slots.typed_data()[g];
      if (slot < 0 || slot >= pool_dims[1]) continue;
      std::memcpy(out + g * row_bytes, base + slot * row_bytes, row_bytes);
    }
  }
  return ffi::Error::Success();
}

ffi::Error GatherWait(ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer tie,
                      ffi::Result<ffi::AnyBuffer> tie_out, int64_t /*tag*/) {
  PassThrough(tie, tie_out);  // no second stream to wait for
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSideGatherStart, GatherStart, hisparse::GatherStartSignature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSideGatherWait, GatherWait, hisparse::GatherWaitSignature(ffi::Ffi::Bind()));
