// The operands, results and attributes of the side-stream gather's two XLA FFI targets, shared
// by the CUDA build (side_stream_gather.cu) and the CPU build (side_stream_gather_cpu.cc), which
// add their own context (the CUDA one: XLA's stream and the device ordinal) in front.
#pragma once

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace hisparse {

// start(pool, layer, host_slots, counts, tie) -> (rows, tie); attributes tag, blocks, threads
template <typename Binding>
auto GatherStartSignature(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding).template Arg<ffi::AnyBuffer>()          // pool row[L, S, W], pinned host
      .template Arg<ffi::Buffer<ffi::S32>>()             // layer i32[1]
      .template Arg<ffi::Buffer<ffi::S32>>()             // host_slots i32[R, K]
      .template Arg<ffi::Buffer<ffi::S32>>()             // counts i32[R]
      .template Arg<ffi::AnyBuffer>()                    // tie
      .template Ret<ffi::AnyBuffer>()                    // rows row[R, K, W]
      .template Ret<ffi::AnyBuffer>()                    // tie (aliased)
      .template Attr<int64_t>("tag")
      .template Attr<int64_t>("blocks")
      .template Attr<int64_t>("threads");
}

// wait(rows, pool, layer, host_slots, counts, tie) -> tie (aliased); attribute tag. rows and the
// start's other operands are passed again to keep them alive; rows is not a result, so XLA never
// copies it (a copy before the wait would read it before the side stream wrote it).
template <typename Binding>
auto GatherWaitSignature(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // rows
      .template Arg<ffi::AnyBuffer>()            // pool
      .template Arg<ffi::AnyBuffer>()            // layer
      .template Arg<ffi::AnyBuffer>()            // host_slots
      .template Arg<ffi::AnyBuffer>()            // counts
      .template Arg<ffi::AnyBuffer>()            // tie
      .template Ret<ffi::AnyBuffer>()            // tie
      .template Attr<int64_t>("tag");
}

}  // namespace hisparse
