#include <pulseloco/base/tensor_view.h>

namespace pulseloco {

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::float32:
      return "float32";
    case DType::bfloat16:
      return "bfloat16";
  }
  return "unknown";
}

}  // namespace pulseloco
