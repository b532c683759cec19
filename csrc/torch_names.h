// Names shared by the torch-side sources (cpu/*.cpp and cuda/*_binding.cpp) so that every back end words
// its one-line errors the same way the Python wrappers do.
#pragma once

#include <c10/core/ScalarType.h>

namespace palestra {

// "float32", "bfloat16", ... as torch's Python side prints dtypes (without the "torch." prefix).
inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return c10::toString(t);
  }
}

}  // namespace palestra
