// sluice::prepacked_linear for CPU, through torch's stable C ABI: the product of a bfloat16/float16
// activation with a weight that oneDNN laid out once at load (engine_service/model/prepacked.py).
//
// A compiled graph cannot take the packed weight itself as an input (an opaque oneDNN tensor has no
// strides to fake), so each PrepackedLinear registers its packed weight here under an integer
// handle and passes the handle, a 0-d int64 tensor, to the operator. The operator was a Python
// function at first: 8 µs a call in a steady loop, and three times that in some processes, 121
// times a decode step (docs/performance.md). Here it is a map lookup and one dispatcher call to
// mkldnn::_linear_pointwise, the operator inductor's own freezing emits.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

std::mutex registry_lock;

std::unordered_map<int64_t, Tensor> &registry() {
  static auto *weights = new std::unordered_map<int64_t, Tensor>();  // never destroyed: no exit-order race
  return *weights;
}

int64_t handle_value(const Tensor &handle) {
  STD_TORCH_CHECK(handle.dim() == 0 && handle.scalar_type() == ScalarType::Long,
                  "prepacked_linear: the handle must be a 0-d int64 tensor");
  return *static_cast<const int64_t *>(handle.data_ptr());
}

void prepacked_register(Tensor handle, Tensor packed) {
  const int64_t key = handle_value(handle);
  std::lock_guard<std::mutex> guard(registry_lock);
  registry().insert_or_assign(key, packed);
}

void prepacked_unregister(Tensor handle) {
  const int64_t key = handle_value(handle);
  std::lock_guard<std::mutex> guard(registry_lock);
  registry().erase(key);
}

Tensor prepacked_linear(Tensor x, Tensor handle, std::optional<Tensor> bias, int64_t out_features) {
  const int64_t key = handle_value(handle);
  std::optional<Tensor> packed;
  {
    std::lock_guard<std::mutex> guard(registry_lock);
    auto found = registry().find(key);
    STD_TORCH_CHECK(found != registry().end(), "prepacked_linear: no packed weight under this handle");
    packed = found->second;
  }
  std::array<StableIValue, 6> stack{
      torch::stable::detail::from(x),
      torch::stable::detail::from(*packed),
      torch::stable::detail::from(bias),
      torch::stable::detail::from(std::string("none")),
      torch::stable::detail::from(std::vector<std::optional<double>>{}),
      torch::stable::detail::from(std::optional<std::string>(std::string()))};
  STABLE_TORCH_ERROR_CODE_CHECK(
      torch_call_dispatcher("mkldnn::_linear_pointwise", "", stack.data(), TORCH_ABI_VERSION));
  Tensor out = torch::stable::detail::to<Tensor>(stack[0]);
  STD_TORCH_CHECK(out.size(out.dim() - 1) == out_features,
                  "prepacked_linear: the packed weight does not have out_features rows");
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("prepacked_linear", TORCH_BOX(&prepacked_linear));
}

STABLE_TORCH_LIBRARY_IMPL(sluice, CompositeExplicitAutograd, m) {
  m.impl("prepacked_register", TORCH_BOX(&prepacked_register));
  m.impl("prepacked_unregister", TORCH_BOX(&prepacked_unregister));
}
