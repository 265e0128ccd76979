// q4_gemv.c as the torch operators sluice::q4_linear (a few activation rows times int4 weights in
// q4_gemv.h's layout) and sluice::dequantize_q4 (those weights as a dense matrix), for CPU,
// through torch's stable C ABI (why that ABI: paged_decode_attention_op.cpp). The schemas and Meta
// implementations are defined in Python (native.py). Each checks what it is handed before the
// kernel reads a byte.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

#include "q4_gemv.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

struct Q4Sizes {
  int64_t n_pad, k, group;
};

Q4Sizes check_weights(const char *op, const Tensor &codes, const Tensor &scales_zeros) {
  STD_TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == ScalarType::Byte && codes.is_contiguous() &&
                      codes.size(2) == 64,
                  op, ": codes must be contiguous uint8 [n/16, k/8, 64]");
  STD_TORCH_CHECK(scales_zeros.dim() == 4 && scales_zeros.scalar_type() == ScalarType::Half &&
                      scales_zeros.is_contiguous() && scales_zeros.size(0) == codes.size(0) &&
                      scales_zeros.size(2) == 2 && scales_zeros.size(3) == Q4_BLOCK_N && scales_zeros.size(1) > 0,
                  op, ": scales_zeros must be contiguous float16 [n/16, k/group, 2, 16]");
  const int64_t k = codes.size(1) * Q4_STEP_K, groups = scales_zeros.size(1);
  STD_TORCH_CHECK(k % groups == 0 && (k / groups) % Q4_XBLOCK == 0, op, ": the group size (k ", k, " over ",
                  groups, " groups) must be a multiple of ", Q4_XBLOCK);
  return {codes.size(0) * Q4_BLOCK_N, k, k / groups};
}

bool q4_supported() { return q4_gemv_supported() != 0; }

Tensor q4_linear(Tensor x, Tensor codes, Tensor scales_zeros, int64_t out_features) {
  const Q4Sizes s = check_weights("q4_linear", codes, scales_zeros);
  STD_TORCH_CHECK(x.dim() >= 1 && x.size(x.dim() - 1) == s.k, "q4_linear: x must end in the weight's ", s.k,
                  " inputs");
  STD_TORCH_CHECK(x.scalar_type() == ScalarType::Float || x.scalar_type() == ScalarType::BFloat16,
                  "q4_linear: x must be float32 or bfloat16");
  STD_TORCH_CHECK(out_features > 0 && out_features <= s.n_pad && s.n_pad - out_features < Q4_BLOCK_N,
                  "q4_linear: out_features ", out_features, " does not fit the weight's ", s.n_pad, " padded rows");
  const Tensor xc = x.is_contiguous() ? x : torch::stable::contiguous(x);
  const int64_t rows = xc.numel() / s.k;
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < x.dim(); d++) sizes.push_back(x.size(d));
  sizes.back() = out_features;
  Tensor out = torch::stable::new_empty(xc, sizes);
  if (rows == 0) return out;
  STD_TORCH_CHECK(rows <= Q4_MAX_ROWS, "q4_linear: at most ", Q4_MAX_ROWS, " rows, got ", rows);
  const auto *w = static_cast<const uint8_t *>(codes.data_ptr());
  const auto *sz = static_cast<const uint16_t *>(scales_zeros.data_ptr());
  const int rc = xc.scalar_type() == ScalarType::Float
      ? q4_linear_f32(w, sz, static_cast<const float *>(xc.data_ptr()), static_cast<float *>(out.data_ptr()), rows,
                      out_features, s.n_pad, s.k, s.group)
      : q4_linear_bf16(w, sz, static_cast<const uint16_t *>(xc.data_ptr()), static_cast<uint16_t *>(out.data_ptr()),
                       rows, out_features, s.n_pad, s.k, s.group);
  STD_TORCH_CHECK(rc == 0, "q4_linear: the kernel failed (", rc == 2 ? "this CPU has no AVX512-VNNI" : "out of memory",
                  ")");
  return out;
}

Tensor dequantize_q4(Tensor codes, Tensor scales_zeros, bool to_float32) {
  const Q4Sizes s = check_weights("dequantize_q4", codes, scales_zeros);
  const auto *w = static_cast<const uint8_t *>(codes.data_ptr());
  const auto *sz = static_cast<const uint16_t *>(scales_zeros.data_ptr());
  if (to_float32) {
    Tensor out = torch::stable::new_empty(scales_zeros, {s.n_pad, s.k}, ScalarType::Float);
    dequantize_q4_f32(w, sz, s.n_pad, s.k, s.group, static_cast<float *>(out.data_ptr()));
    return out;
  }
  Tensor out = torch::stable::new_empty(scales_zeros, {s.n_pad, s.k}, ScalarType::BFloat16);
  dequantize_q4_bf16(w, sz, s.n_pad, s.k, s.group, static_cast<uint16_t *>(out.data_ptr()));
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("q4_linear", TORCH_BOX(&q4_linear));
  m.impl("dequantize_q4", TORCH_BOX(&dequantize_q4));
}

STABLE_TORCH_LIBRARY_IMPL(sluice, CompositeExplicitAutograd, m) {
  m.impl("q4_supported", TORCH_BOX(&q4_supported));
}
