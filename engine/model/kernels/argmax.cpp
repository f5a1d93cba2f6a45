// miniserve::argmax_rows — the greedy token of each row of logits (rows, vocab), fp32 or bf16,
// read once, rows spread over torch's threads.
//
// Why: torch's argmax over a (32, 151936) fp32 row block runs on one core at ~10 GB/s (2 ms, ~1%
// of a fp32 decode call at B=32), and bf16 logits were first copied to fp32 (bf16 argmax is 4x
// slower still). Same answer as torch.argmax: the first index of the largest value, and the first
// NaN if a row has one. fp32 has an AVX2 form for CPUs without AVX-512 (bf16 logits are AVX-512's
// alone: an AVX2-only CPU runs fp32).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace {

#ifdef MINISERVE_X86

using namespace miniserve_simd;

template <typename T>
float scalar(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return p[i];
  } else {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
}

// per lane of one chain: the largest value seen and the first index holding it (later equal values
// lose); NaN lanes noted
struct Chain {
  __m512 best;
  __m512i best_at;
};

template <typename T>
MINISERVE_TARGET inline void step(Chain& c, const T* x, int64_t i, __mmask16 m, __mmask16& nan) {
  const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, load16(x + i, m));
  nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __mmask16 gt = _mm512_cmp_ps_mask(v, c.best, _CMP_GT_OQ);
  c.best = _mm512_mask_mov_ps(c.best, gt, v);
  c.best_at = _mm512_mask_mov_epi32(c.best_at, gt,
                                    _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i)),
                                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
}

template <typename T>
MINISERVE_TARGET int64_t argmax_row(const T* x, int64_t n) {
  // four chains over interleaved vectors: one chain's compare-and-keep waits on its last, so a
  // single chain ran at the latency of that pair, not at the rate the values load
  constexpr int kChains = 4;
  Chain c[kChains];
  for (auto& ch : c) ch = {_mm512_set1_ps(-INFINITY), _mm512_set1_epi32(0)};
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 * kChains <= n; i += 16 * kChains) {
    for (int j = 0; j < kChains; ++j) step(c[j], x, i + 16 * j, __mmask16(0xFFFF), nan);
  }
  for (int j = 0; i < n; i += 16, ++j) step(c[j], x, i, lanes(n - i), nan);
  if (nan) {
    for (int64_t k = 0; k < n; ++k) {
      if (std::isnan(scalar(x, k))) return k;
    }
  }
  __m512 best = c[0].best;
  for (int j = 1; j < kChains; ++j) best = _mm512_max_ps(best, c[j].best);
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  // among the lanes of every chain holding the largest value, the smallest index; all -inf: index 0
  __m512i idx = _mm512_set1_epi32(INT32_MAX);
  for (int j = 0; j < kChains; ++j)
    idx = _mm512_min_epi32(idx, _mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX),
                                                      _mm512_cmp_ps_mask(c[j].best, top, _CMP_EQ_OQ), c[j].best_at));
  const int32_t first = _mm512_reduce_min_epi32(idx);
  return first == INT32_MAX ? 0 : first;
}

// argmax_row in AVX2, fp32: the same four chains in 8 lanes over the whole vectors, then the ragged
// tail one by one (a later index wins only if strictly larger; no masked loads, which cost AMD's
// cores extra uops)
struct Chain8 {
  __m256 best;
  __m256i best_at;
};

MINISERVE_TARGET_AVX2 inline void step8(Chain8& c, const float* x, int64_t i, __m256& nan) {
  const __m256 v = _mm256_loadu_ps(x + i);
  nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256 gt = _mm256_cmp_ps(v, c.best, _CMP_GT_OQ);
  c.best = _mm256_blendv_ps(c.best, v, gt);
  const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  c.best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(c.best_at), _mm256_castsi256_ps(at), gt));
}

MINISERVE_TARGET_AVX2 int64_t argmax_row_avx2(const float* x, int64_t n) {
  constexpr int kChains = 4;
  Chain8 c[kChains];
  for (auto& ch : c) ch = {_mm256_set1_ps(-INFINITY), _mm256_setzero_si256()};
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 * kChains <= n; i += 8 * kChains) {
    for (int j = 0; j < kChains; ++j) step8(c[j], x, i + 8 * j, nan);
  }
  for (int j = 0; i + 8 <= n; i += 8, ++j) step8(c[j], x, i, nan);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t k = i; k < n && !has_nan; ++k) has_nan = std::isnan(x[k]);
  if (has_nan) {
    for (int64_t k = 0; k < n; ++k) {
      if (std::isnan(x[k])) return k;
    }
  }
  float lanes_best[8 * kChains];
  int32_t lanes_at[8 * kChains];
  for (int j = 0; j < kChains; ++j) {
    _mm256_storeu_ps(lanes_best + 8 * j, c[j].best);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes_at + 8 * j), c[j].best_at);
  }
  // the lanes' largest value and its smallest index (all -inf: index 0), then the tail
  float top = -INFINITY;
  int64_t first = 0;
  for (int l = 0; l < 8 * kChains; ++l) {
    if (lanes_best[l] > top || (lanes_best[l] == top && lanes_at[l] < first)) {
      top = lanes_best[l];
      first = lanes_at[l];
    }
  }
  for (; i < n; ++i) {
    if (x[i] > top) {
      top = x[i];
      first = i;
    }
  }
  return first;
}

#endif  // MINISERVE_X86

bool argmax_supported(at::ScalarType dtype) {
#ifdef MINISERVE_X86
  return (dtype == at::kFloat && (cpu_has_avx512() || cpu_has_avx2())) ||
         (dtype == at::kBFloat16 && cpu_has_avx512());
#else
  return false;
#endif
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  const char* op = "miniserve::argmax_rows: ";
  TORCH_CHECK(argmax_supported(logits.scalar_type()), op, "no kernel for ", logits.scalar_type(), " on this CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) >= 1 && logits.size(1) < INT32_MAX, op,
              "logits must be a contiguous (rows, vocab) tensor, got ", logits.sizes());
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
#ifdef MINISERVE_X86
  int64_t* o = out.data_ptr<int64_t>();
  const bool wide = cpu_has_avx512();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      o[r] = logits.scalar_type() != at::kFloat
                 ? argmax_row(reinterpret_cast<const uint16_t*>(logits.data_ptr<c10::BFloat16>()) + r * n, n)
             : wide ? argmax_row(logits.data_ptr<float>() + r * n, n)
                    : argmax_row_avx2(logits.data_ptr<float>() + r * n, n);
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(miniserve, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("argmax_supported(ScalarType dtype) -> bool", &argmax_supported);
}

TORCH_LIBRARY_IMPL(miniserve, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
