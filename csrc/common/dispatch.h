// Dispatch helpers shared by the ops: the dtypes every compute kernel supports, and calling a
// registered tp_ext op through the dispatcher (so tracing sees the op, not its kernel).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

// Runs the lambda (__VA_ARGS__) with scalar_t bound to TYPE's C++ type, for the floating dtypes
// of every tp_ext compute kernel: float32, float64, bfloat16, float16. NAME names the kernel in
// the "not implemented for" error.
#define TP_EXT_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

namespace tp_ext {

// The registered op tp_ext::<name> (overload ""); throws if it has no schema.
inline c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((std::string("tp_ext::") + name).c_str(),
                                                        "");
}

}  // namespace tp_ext
