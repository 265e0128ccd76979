// The decode attention kernel (paged_decode_attention.c) as the torch operator
// sluice::paged_decode_attention, registered for CPU through torch's stable C ABI.
//
// Why a C++ binding at all: the operator is called once per layer per step, and a Python
// implementation behind it (ctypes) cost 5 µs a call with warm caches and ~30 µs a call in a real
// step, where every layer's weights have just streamed through the caches and the interpreter's
// objects are cold. Why the stable ABI: its headers are the shim's C declarations and a few
// header-only templates, so this file builds in about a second on two cores; the full ATen headers
// take about a minute and ninja (torch.utils.cpp_extension).
//
// The schema and the Meta (shape) implementation are defined in Python (native.py); this library
// only adds the CPU kernel. It checks what it is handed: the engine builds these tensors itself,
// but an operator must not read memory it was not given a right to.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

#include "bf16.h"
#include "paged_decode_attention.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// exact: a bfloat16 cache's rows of one sequence never take AMX scores together (the _exact entry)
Tensor attend(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, double scale,
              bool exact) {
  STD_TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q must be [batch, heads, head_dim]");
  STD_TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
                  "paged_decode_attention: caches must be [blocks, block_size, kv_heads, head_dim]");
  const ScalarType cache_type = k_cache.scalar_type();
  STD_TORCH_CHECK(cache_type == ScalarType::Float || cache_type == ScalarType::BFloat16 || cache_type == ScalarType::Half,
                  "paged_decode_attention: no kernel for this cache dtype (float32, bfloat16 or float16 only)");
  STD_TORCH_CHECK(v_cache.scalar_type() == cache_type, "paged_decode_attention: K and V caches differ in dtype");
  STD_TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
                  "paged_decode_attention: the caches must be contiguous");
  for (int64_t d = 0; d < 4; d++)
    STD_TORCH_CHECK(k_cache.size(d) == v_cache.size(d), "paged_decode_attention: K and V caches differ in shape");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  STD_TORCH_CHECK(k_cache.size(3) == head_dim, "paged_decode_attention: the cache's head size is not the query's");
  STD_TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads <= PDA_MAX_HEADS && head_dim <= PDA_MAX_HEAD_DIM,
                  "paged_decode_attention: no kernel for ", heads, " heads over ", kv_heads, " kv heads of size ",
                  head_dim, " (at most ", PDA_MAX_HEADS, " heads, a multiple of the kv heads, of size at most ",
                  PDA_MAX_HEAD_DIM, ")");
  STD_TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch &&
                      block_tables.scalar_type() == ScalarType::Long,
                  "paged_decode_attention: block_tables must be int64 [batch, width]");
  STD_TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == batch &&
                      context_lens.scalar_type() == ScalarType::Long,
                  "paged_decode_attention: context_lens must be int64 [batch]");
  // Only what needs it is copied: every dispatcher call costs µs here (the step's inputs are
  // already contiguous), and tens of µs when the caches are cold. A bfloat16 query (the bfloat16
  // model's) is widened here and its output rounded back here, as torch's casts would, without
  // two casts through the dispatcher (a fifth of the operator's time for one stream).
  const bool bf16_q = q.scalar_type() == ScalarType::BFloat16;
  const Tensor query = q.scalar_type() != ScalarType::Float && !bf16_q
                           ? torch::stable::contiguous(torch::stable::to(q, ScalarType::Float))
                       : q.is_contiguous() ? q
                                           : torch::stable::contiguous(q);
  const Tensor tables = block_tables.is_contiguous() ? block_tables : torch::stable::contiguous(block_tables);
  const Tensor lens = context_lens.is_contiguous() ? context_lens : torch::stable::contiguous(context_lens);
  // every visible token's block is in its row of the table, and in the cache
  const int64_t width = tables.size(1), num_blocks = k_cache.size(0);
  const int64_t *len_data = static_cast<const int64_t *>(lens.data_ptr());
  const int64_t *table_data = static_cast<const int64_t *>(tables.data_ptr());
  for (int64_t b = 0; b < batch; b++) {
    STD_TORCH_CHECK(len_data[b] <= width * block_size,
                    "paged_decode_attention: a context is longer than its block table");
    for (int64_t m = 0; m * block_size < len_data[b]; m++)
      STD_TORCH_CHECK(table_data[b * width + m] >= 0 && table_data[b * width + m] < num_blocks,
                      "paged_decode_attention: a block table names a block outside the cache");
  }
  Tensor out = torch::stable::empty_like(query);
  const int64_t n = batch * heads * head_dim;
  std::vector<float> q_wide, out_wide;
  const float *q_data;
  float *out_data;
  if (bf16_q) {
    const auto *src = static_cast<const uint16_t *>(query.data_ptr());
    q_wide.resize(static_cast<size_t>(n));
    out_wide.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; i++) q_wide[i] = bf16_to_f32(src[i]);
    q_data = q_wide.data();
    out_data = out_wide.data();
  } else {
    q_data = static_cast<const float *>(query.data_ptr());
    out_data = static_cast<float *>(out.data_ptr());
  }
  int rc;
  if (cache_type == ScalarType::Float) {
    rc = paged_decode_attention_f32(
        q_data, static_cast<const float *>(k_cache.data_ptr()),
        static_cast<const float *>(v_cache.data_ptr()), table_data,
        width, len_data, out_data, batch, heads, kv_heads, head_dim,
        block_size, static_cast<float>(scale));
  } else if (cache_type == ScalarType::Half) {
    rc = paged_decode_attention_f16(
        q_data, static_cast<const uint16_t *>(k_cache.data_ptr()),
        static_cast<const uint16_t *>(v_cache.data_ptr()), table_data,
        width, len_data, out_data, batch, heads, kv_heads, head_dim,
        block_size, static_cast<float>(scale));
  } else {
    rc = (exact ? paged_decode_attention_bf16_exact : paged_decode_attention_bf16)(
        q_data, static_cast<const uint16_t *>(k_cache.data_ptr()),
        static_cast<const uint16_t *>(v_cache.data_ptr()), table_data,
        width, len_data, out_data, batch, heads, kv_heads, head_dim,
        block_size, static_cast<float>(scale));
  }
  STD_TORCH_CHECK(rc == 0, "paged_decode_attention: could not allocate its work buffers");  // shapes: checked above
  if (bf16_q) {
    auto *dst = static_cast<uint16_t *>(out.data_ptr());
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(out_wide[i]);
    return out;
  }
  return q.scalar_type() == ScalarType::Float ? out : torch::stable::to(out, q.scalar_type());
}

Tensor paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens,
                              double scale) {
  return attend(q, k_cache, v_cache, block_tables, context_lens, scale, false);
}

// every row's output the same as a lone row's bit for bit (a deterministic engine's attention)
Tensor paged_decode_attention_exact(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables,
                                    Tensor context_lens, double scale) {
  return attend(q, k_cache, v_cache, block_tables, context_lens, scale, true);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention));
  m.impl("paged_decode_attention_exact", TORCH_BOX(&paged_decode_attention_exact));
}
