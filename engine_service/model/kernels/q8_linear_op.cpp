// q8_gemv.c as the torch operators sluice::q8_linear (a few activation rows times int8
// block-quantized weights in q8_gemv.h's layout) and sluice::dequantize_q8 (those weights as a dense
// matrix), for CPU, through torch's stable C ABI (as q4_linear_op.cpp). The schemas and Meta
// implementations are defined in Python (native.py). Each checks what it is handed before the
// kernel reads a byte.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

#include "q8_gemv.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

struct Q8Sizes {
  int64_t n_pad, k, group;
};

Q8Sizes check_weights(const char *op, const Tensor &codes, const Tensor &scales) {
  STD_TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == ScalarType::Byte && codes.is_contiguous() &&
                      codes.size(0) > 0 && codes.size(1) > 0 && codes.size(2) == 64,
                  op, ": codes must be contiguous uint8 [n/16, k/4, 64]");
  STD_TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == ScalarType::Float && scales.is_contiguous() &&
                      scales.size(0) == codes.size(0) && scales.size(2) == Q8_BLOCK_N && scales.size(1) > 0,
                  op, ": scales must be contiguous float32 [n/16, k/group, 16]");
  const int64_t k = codes.size(1) * Q8_STEP_K, groups = scales.size(1);
  STD_TORCH_CHECK(k % Q8_XBLOCK == 0, op, ": the inputs (", k, ") must be a multiple of ", Q8_XBLOCK);
  STD_TORCH_CHECK(k % groups == 0 && (k / groups == 16 || k / groups == 32), op, ": the group size (k ", k,
                  " over ", groups, " groups) must be 16 or 32");
  return {codes.size(0) * Q8_BLOCK_N, k, k / groups};
}

bool q8_supported() { return q8_gemv_supported() != 0; }

Tensor q8_linear(Tensor x, Tensor codes, Tensor scales, int64_t out_features) {
  const Q8Sizes s = check_weights("q8_linear", codes, scales);
  STD_TORCH_CHECK(x.dim() >= 1 && x.size(x.dim() - 1) == s.k, "q8_linear: x must end in the weight's ", s.k,
                  " inputs");
  STD_TORCH_CHECK(x.scalar_type() == ScalarType::Float || x.scalar_type() == ScalarType::BFloat16,
                  "q8_linear: x must be float32 or bfloat16");
  STD_TORCH_CHECK(out_features > 0 && out_features <= s.n_pad && s.n_pad - out_features < Q8_BLOCK_N,
                  "q8_linear: out_features ", out_features, " does not fit the weight's ", s.n_pad, " padded rows");
  const Tensor xc = x.is_contiguous() ? x : torch::stable::contiguous(x);
  const int64_t rows = xc.numel() / s.k;
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < x.dim(); d++) sizes.push_back(x.size(d));
  sizes.back() = out_features;
  Tensor out = torch::stable::new_empty(xc, sizes);
  if (rows == 0) return out;
  STD_TORCH_CHECK(rows <= Q8_MAX_ROWS, "q8_linear: at most ", Q8_MAX_ROWS, " rows, got ", rows);
  const auto *w = static_cast<const uint8_t *>(codes.data_ptr());
  const auto *sc = static_cast<const float *>(scales.data_ptr());
  const int rc = xc.scalar_type() == ScalarType::Float
      ? q8_linear_f32(w, sc, static_cast<const float *>(xc.data_ptr()), static_cast<float *>(out.data_ptr()), rows,
                      out_features, s.n_pad, s.k, s.group)
      : q8_linear_bf16(w, sc, static_cast<const uint16_t *>(xc.data_ptr()), static_cast<uint16_t *>(out.data_ptr()),
                       rows, out_features, s.n_pad, s.k, s.group);
  STD_TORCH_CHECK(rc == 0, "q8_linear: the kernel failed (", rc == 2 ? "this CPU has no AVX512-VNNI" : "out of memory",
                  ")");
  return out;
}

Tensor dequantize_q8(Tensor codes, Tensor scales, bool to_float32) {
  const Q8Sizes s = check_weights("dequantize_q8", codes, scales);
  const auto *w = static_cast<const uint8_t *>(codes.data_ptr());
  const auto *sc = static_cast<const float *>(scales.data_ptr());
  if (to_float32) {
    Tensor out = torch::stable::new_empty(scales, {s.n_pad, s.k});
    dequantize_q8_f32(w, sc, s.n_pad, s.k, s.group, static_cast<float *>(out.data_ptr()));
    return out;
  }
  Tensor out = torch::stable::new_empty(scales, {s.n_pad, s.k}, ScalarType::BFloat16);
  dequantize_q8_bf16(w, sc, s.n_pad, s.k, s.group, static_cast<uint16_t *>(out.data_ptr()));
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("q8_linear", TORCH_BOX(&q8_linear));
  m.impl("dequantize_q8", TORCH_BOX(&dequantize_q8));
}

STABLE_TORCH_LIBRARY_IMPL(sluice, CompositeExplicitAutograd, m) {
  m.impl("q8_supported", TORCH_BOX(&q8_supported));
}
