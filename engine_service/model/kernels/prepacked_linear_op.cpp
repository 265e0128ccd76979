// sluice::prepacked_linear for CPU, through torch's stable C ABI: the product of a bfloat16/float16
// activation with a weight that oneDNN laid out once at load (engine_service/model/prepacked.py).
//
// A compiled graph cannot take the packed weight itself as an input (an opaque oneDNN tensor has no
// strides to fake), so each PrepackedLinear registers its packed weight here under an integer
// handle and passes the handle, a 0-d int64 tensor, to the operator. The operator was a Python
// function at first: 8 µs a call in a steady loop, and three times that in some processes, 121
// times a decode step (docs/performance.md). Here it is a map lookup and one dispatcher call to
// mkldnn::_linear_pointwise, the operator inductor's own freezing emits.
//
// A few rows of bfloat16 (one stream's decode step, its drafts, a small batch: up to
// packed_gemm_bf16_max_rows) run packed_gemv.c on the same packed weight instead, when the layer
// registered the weight's address: prepacked.py does that only after checking, at load, that the
// packed buffer is the layout the kernel reads.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "packed_gemv.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

std::mutex registry_lock;

struct Packed {
  Tensor weight;                    // oneDNN's packed tensor (keeps the buffer below alive)
  const uint16_t *gemv = nullptr;   // its data, when packed_gemv may read it; else null
  int64_t out_features = 0, in_features = 0, out_padded = 0, in_padded = 0;
  // a deterministic engine's layer: every row count runs packed_gemv on groups of rows (no AMX
  // tiles), each row's sums the one-row kernel's bit for bit (prepacked_set_deterministic)
  bool deterministic = false;
};

std::unordered_map<int64_t, Packed> &registry() {
  static auto *weights = new std::unordered_map<int64_t, Packed>();  // never destroyed: no exit-order race
  return *weights;
}

int64_t handle_value(const Tensor &handle) {
  STD_TORCH_CHECK(handle.dim() == 0 && handle.scalar_type() == ScalarType::Long,
                  "prepacked_linear: the handle must be a 0-d int64 tensor");
  return *static_cast<const int64_t *>(handle.data_ptr());
}

// gemv_data: the packed buffer's address (torch.ops.mkldnn.data_ptr) when its layout was checked
// to be packed_gemv's, with the weight's sizes and their padded sizes; 0: oneDNN for every product.
void prepacked_register(Tensor handle, Tensor packed, int64_t gemv_data, int64_t out_features, int64_t in_features,
                        int64_t out_padded, int64_t in_padded) {
  const int64_t key = handle_value(handle);
  Packed entry{packed};
  if (gemv_data != 0) {
    STD_TORCH_CHECK(packed_gemv_bf16_supported(), "prepacked_register: this build has no bfloat16 GEMV kernel");
    STD_TORCH_CHECK(packed_gemv_sizes_ok(out_features, in_features, out_padded, in_padded),
                    "prepacked_register: sizes that are not the GEMV layout's");
    entry.gemv = reinterpret_cast<const uint16_t *>(gemv_data);
    entry.out_features = out_features;
    entry.in_features = in_features;
    entry.out_padded = out_padded;
    entry.in_padded = in_padded;
  }
  std::lock_guard<std::mutex> guard(registry_lock);
  registry().insert_or_assign(key, entry);
}

void prepacked_set_deterministic(Tensor handle, bool on) {
  const int64_t key = handle_value(handle);
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry().find(key);
  STD_TORCH_CHECK(found != registry().end(), "prepacked_set_deterministic: no packed weight under this handle");
  STD_TORCH_CHECK(!on || found->second.gemv != nullptr,
                  "prepacked_set_deterministic: this weight is not in the GEMV's layout");
  found->second.deterministic = on;
}

bool packed_gemv_supported() { return packed_gemv_bf16_supported() != 0; }

int64_t packed_gemv_max_rows() { return packed_gemm_bf16_max_rows(); }

void prepacked_unregister(Tensor handle) {
  const int64_t key = handle_value(handle);
  std::lock_guard<std::mutex> guard(registry_lock);
  registry().erase(key);
}

Tensor prepacked_linear(Tensor x, Tensor handle, std::optional<Tensor> bias, int64_t out_features) {
  const int64_t key = handle_value(handle);
  std::optional<Packed> packed;
  {
    std::lock_guard<std::mutex> guard(registry_lock);
    auto found = registry().find(key);
    STD_TORCH_CHECK(found != registry().end(), "prepacked_linear: no packed weight under this handle");
    packed = found->second;
  }
  const int64_t rows = x.dim() >= 1 && packed->in_features > 0 ? x.numel() / packed->in_features : 0;
  if (packed->gemv != nullptr && x.scalar_type() == ScalarType::BFloat16 && x.is_contiguous() && x.dim() >= 1 &&
      x.size(x.dim() - 1) == packed->in_features && rows >= 1 &&
      (packed->deterministic || rows <= packed_gemm_bf16_max_rows()) &&
      out_features == packed->out_features &&
      (!bias.has_value() || (bias->scalar_type() == ScalarType::BFloat16 && bias->is_contiguous() &&
                             bias->numel() == out_features))) {
    std::vector<int64_t> sizes;
    for (int64_t d = 0; d < x.dim(); d++) sizes.push_back(x.size(d));
    sizes.back() = out_features;
    Tensor out = torch::stable::new_empty(x, sizes);
    const int rc = packed_gemm_bf16_flags(
        packed->gemv, static_cast<const uint16_t *>(x.data_ptr()),
        bias.has_value() ? static_cast<const uint16_t *>(bias->data_ptr()) : nullptr,
        static_cast<uint16_t *>(out.data_ptr()), rows, packed->out_features, packed->in_features,
        packed->out_padded, packed->in_padded, packed->deterministic ? PG_NO_TILES : 0);
    STD_TORCH_CHECK(rc == 0, "prepacked_linear: the bfloat16 GEMV failed (", rc, ")");
    return out;
  }
  std::array<StableIValue, 6> stack{
      torch::stable::detail::from(x),
      torch::stable::detail::from(packed->weight),
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
  m.impl("prepacked_set_deterministic", TORCH_BOX(&prepacked_set_deterministic));
  m.impl("packed_gemv_supported", TORCH_BOX(&packed_gemv_supported));
  m.impl("packed_gemv_max_rows", TORCH_BOX(&packed_gemv_max_rows));
  m.impl("prepacked_unregister", TORCH_BOX(&prepacked_unregister));
}
