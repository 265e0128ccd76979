// The dequantization kernels (dequantize.c) as the torch operators sluice::dequantize_int4 and
// sluice::dequantize_int8, registered for CPU through torch's stable C ABI (why that ABI:
// paged_decode_attention_op.cpp). The schemas and Meta implementations are defined in Python
// (native.py). Each checks what it is handed before the kernel reads a byte.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>

#include "dequantize.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

Tensor dequantize_int4(Tensor packed, Tensor scales_zeros, int64_t group_size) {
  STD_TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == ScalarType::Byte && packed.is_contiguous(),
                  "dequantize_int4: packed must be contiguous uint8 [n, k/2] (torch's CPU int4 layout)");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  STD_TORCH_CHECK(n % DQ_INT4_BLOCK_N == 0, "dequantize_int4: the output size ", n, " is not a multiple of ",
                  DQ_INT4_BLOCK_N);
  STD_TORCH_CHECK(group_size > 0 && group_size <= DQ_INT4_MAX_GROUP && k % group_size == 0,
                  "dequantize_int4: the input size ", k, " is not a multiple of the group size ", group_size,
                  " (at most ", DQ_INT4_MAX_GROUP, ")");
  const ScalarType dtype = scales_zeros.scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::Float || dtype == ScalarType::BFloat16,
                  "dequantize_int4: scales must be float32 or bfloat16");
  STD_TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.size(0) == k / group_size && scales_zeros.size(1) == n &&
                      scales_zeros.size(2) == 2,
                  "dequantize_int4: scales_zeros must be [k/group_size, n, 2]");
  const Tensor sz = scales_zeros.is_contiguous() ? scales_zeros : torch::stable::contiguous(scales_zeros);
  Tensor out = torch::stable::new_empty(sz, {n, k});
  if (dtype == ScalarType::Float) {
    dequantize_int4_f32(static_cast<const uint8_t *>(packed.data_ptr()), static_cast<const float *>(sz.data_ptr()), n,
                        k, group_size, static_cast<float *>(out.data_ptr()));
  } else {
    dequantize_int4_bf16(static_cast<const uint8_t *>(packed.data_ptr()), static_cast<const uint16_t *>(sz.data_ptr()),
                         n, k, group_size, static_cast<uint16_t *>(out.data_ptr()));
  }
  return out;
}

Tensor dequantize_int8(Tensor q, Tensor scales) {
  STD_TORCH_CHECK(q.dim() == 2 && q.scalar_type() == ScalarType::Char, "dequantize_int8: q must be int8 [n, k]");
  const int64_t n = q.size(0), k = q.size(1);
  const ScalarType dtype = scales.scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::Float || dtype == ScalarType::BFloat16,
                  "dequantize_int8: scales must be float32 or bfloat16");
  STD_TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n, "dequantize_int8: scales must be [n]");
  const Tensor qc = q.is_contiguous() ? q : torch::stable::contiguous(q);
  const Tensor sc = scales.is_contiguous() ? scales : torch::stable::contiguous(scales);
  Tensor out = torch::stable::new_empty(sc, {n, k});
  if (dtype == ScalarType::Float) {
    dequantize_int8_f32(static_cast<const int8_t *>(qc.data_ptr()), static_cast<const float *>(sc.data_ptr()), n, k,
                        static_cast<float *>(out.data_ptr()));
  } else {
    dequantize_int8_bf16(static_cast<const int8_t *>(qc.data_ptr()), static_cast<const uint16_t *>(sc.data_ptr()), n,
                         k, static_cast<uint16_t *>(out.data_ptr()));
  }
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("dequantize_int4", TORCH_BOX(&dequantize_int4));
  m.impl("dequantize_int8", TORCH_BOX(&dequantize_int8));
}
