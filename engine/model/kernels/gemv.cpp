// miniserve::gemv — y (M, N) = x (M, K) · wᵀ + bias with w pre-arranged in panels. Made for
// decode-sized M (a decode step, a short chunk, a prefill's sampled rows); any M runs, row_block
// rows per pass over the weights (engine/model/kernels/dispatch.py sizes it from the CPU's cache
// and measures the kernel against oneDNN and F.linear at each row count before the engine uses it).
//
// Why: a decode step reads every weight once and does little arithmetic with it, so at a few rows
// its time is how fast the weights stream from memory. At 1-8 rows oneDNN's linear reads the 0.5B
// model's weights at 23-31 GB/s on this 2-core VM (least at 1, 2 and 8 rows), below what a plain
// sweep of the same bytes reaches. Here each weight byte is loaded once, in address order, and
// used for up to 8 rows while it is in a register: w is stored as panels of 32 output columns
// (engine/kernels/__init__.py pack_panels), so one k step of a panel is two vectors holding 32
// outputs' weights; each row's x[k] is broadcast and multiplied in (fp32 FMA; bf16 AVX512-BF16
// dot products over k pairs, summed in fp32 as oneDNN's bf16 matmul does, except that these
// instructions flush bf16 denormals to zero). Past 8 rows a panel is multiplied into the rows 8 at
// a time while it sits in cache, so the weights still come from memory once and the work becomes
// FMA-bound: 90% of this CPU's fp32 peak and 91% of its bf16 peak at 32 rows, where oneDNN reaches
// 83% and 81%. Accumulators stay in registers for the whole K, so there are no reductions across
// lanes; with one running sum per output the fp32 error grows with K a little faster than
// oneDNN's blocked sums (~1e-5 on the 0.5B model's logits). Each thread takes a contiguous run of
// panels: one forward stream. The bias is added in fp32 and the result rounded once to the input
// dtype. benchmarks/gemv_kernel.py measures it against oneDNN.
//
// Built at first use by engine/kernels/__init__.py (torch.utils.cpp_extension). The kernels are
// compiled for AVX-512 with target attributes and only run where the CPU has it
// (miniserve::gemv_supported); elsewhere the engine keeps oneDNN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

constexpr int64_t kPanel = 32;     // output columns per panel (engine/kernels/__init__.py PANEL)
constexpr int64_t kBlockRows = 8;  // rows per register block: 2 accumulators per row, 16 of 32 registers

#ifdef MINISERVE_X86

using namespace miniserve_simd;

bool cpu_has(bool bf16) {  // bf16 also needs AVX512-BF16's dot products
  return bf16 ? cpu_has_avx512_bf16() : cpu_has_avx512();
}

// wp: (panels, K, 32) fp32
template <int M>
MINISERVE_TARGET void panels_f32(const float* x, const float* wp, const float* bias,
                                                                  float* y, int64_t p0, int64_t p1, int64_t K,
                                                                  int64_t N) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* w = wp + p * K * kPanel;
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m512 w0 = _mm512_loadu_ps(w + k * kPanel), w1 = _mm512_loadu_ps(w + k * kPanel + 16);
      for (int m = 0; m < M; ++m) {
        const __m512 xb = _mm512_set1_ps(x[m * K + k]);
        a0[m] = _mm512_fmadd_ps(w0, xb, a0[m]);
        a1[m] = _mm512_fmadd_ps(w1, xb, a1[m]);
      }
    }
    const int64_t n0 = p * kPanel;
    const __mmask16 k0 = lanes(N - n0), k1 = lanes(N - n0 - 16);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = bias && k1 ? _mm512_maskz_loadu_ps(k1, bias + n0 + 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      _mm512_mask_storeu_ps(y + m * N + n0, k0, _mm512_add_ps(a0[m], b0));
      if (k1) _mm512_mask_storeu_ps(y + m * N + n0 + 16, k1, _mm512_add_ps(a1[m], b1));
    }
  }
}

// wp: (panels, ceil(K / 2), 32, 2) bf16: lane j of a vector holds output j's weights for k pair kk
template <int M>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16"))) void panels_bf16(
    const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y, int64_t p0, int64_t p1, int64_t K,
    int64_t N) {
  const int64_t pairs = (K + 1) / 2, full = K / 2;
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* w = wp + p * pairs * kPanel * 2;
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < pairs; ++kk) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kk * kPanel * 2);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kk * kPanel * 2 + 32);
      for (int m = 0; m < M; ++m) {
        // x[2kk] in the low half of each 32-bit lane, x[2kk + 1] in the high: broadcast, one dot
        // product. The last pair of an odd K has no x[2kk + 1] (its weights there are 0).
        uint32_t pair;
        if (kk < full) {
          std::memcpy(&pair, x + m * K + 2 * kk, 4);
        } else {
          pair = x[m * K + K - 1];
        }
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        a0[m] = _mm512_dpbf16_ps(a0[m], w0, xb);
        a1[m] = _mm512_dpbf16_ps(a1[m], w1, xb);
      }
    }
    const int64_t n0 = p * kPanel;
    const __mmask16 k0 = lanes(N - n0), k1 = lanes(N - n0 - 16);
    const __m512 b0 = bias ? load16(bias + n0, k0) : _mm512_setzero_ps();
    const __m512 b1 = bias && k1 ? load16(bias + n0 + 16, k1) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {  // round to nearest even, once
      _mm256_mask_storeu_epi16(y + m * N + n0, k0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0[m], b0)));
      if (k1) {
        _mm256_mask_storeu_epi16(y + m * N + n0 + 16, k1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a1[m], b1)));
      }
    }
  }
}

template <typename Fn>
void for_rows(int64_t M, Fn&& fn) {
  switch (M) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

// fn(r0, r1, rows in the last 8-row block) for each run of row_block rows
template <typename Fn>
void for_chunks(int64_t M, int64_t row_block, Fn&& fn) {
  for (int64_t r0 = 0; r0 < M; r0 += row_block) {
    const int64_t r1 = std::min(M, r0 + row_block), n = r1 - r0;
    fn(r0, r1, n - (n - 1) / kBlockRows * kBlockRows);
  }
}

#endif  // MINISERVE_X86

bool gemv_supported(at::ScalarType dtype) {
#ifdef MINISERVE_X86
  if (dtype == at::kFloat) return cpu_has(false);
  if (dtype == at::kBFloat16) return cpu_has(true);
#endif
  return false;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, int64_t N,
               int64_t K, int64_t row_block) {
  TORCH_CHECK(gemv_supported(x.scalar_type()), "miniserve::gemv: no kernel for ", x.scalar_type(), " on this CPU");
  TORCH_CHECK(x.dim() == 2, "miniserve::gemv: x must be 2-D (rows, K)");
  TORCH_CHECK(x.is_contiguous() && wp.is_contiguous(), "miniserve::gemv: x and the panels must be contiguous");
  TORCH_CHECK(wp.scalar_type() == x.scalar_type(), "miniserve::gemv: x is ", x.scalar_type(), ", the panels are ",
              wp.scalar_type());
  TORCH_CHECK(x.size(1) == K, "miniserve::gemv: x has ", x.size(1), " columns, the panels were packed for ", K);
  const int64_t M = x.size(0), panels = (N + kPanel - 1) / kPanel;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const std::vector<int64_t> shape = bf16 ? std::vector<int64_t>{panels, (K + 1) / 2, kPanel, 2}
                                          : std::vector<int64_t>{panels, K, kPanel};
  TORCH_CHECK(N >= 1 && wp.sizes() == at::IntArrayRef(shape), "miniserve::gemv: panels of shape ", wp.sizes(),
              " do not hold ", N, " outputs of ", K, " inputs (pack them with engine.kernels.pack_panels)");
  TORCH_CHECK(M >= 1, "miniserve::gemv: at least one row, got ", M);
  TORCH_CHECK(row_block >= kBlockRows && row_block % kBlockRows == 0, "miniserve::gemv: row_block must be a ",
              "multiple of ", kBlockRows, ", got ", row_block);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "miniserve::gemv: bias must be a contiguous (", N, ",) tensor of x's dtype");
  }
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef MINISERVE_X86
  const int64_t grain = std::max<int64_t>(1, panels / std::max(1, at::get_num_threads()));
  // each thread takes a run of panels; past 8 rows, each panel is multiplied into the rows 8 at a
  // time while it sits in cache, so the weights stream from memory once per row_block rows (the
  // rows of x read again for every panel stay in cache)
  if (!bf16) {
    const float *xp = x.data_ptr<float>(), *wpp = wp.data_ptr<float>();
    const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    for_chunks(M, row_block, [&](int64_t r0, int64_t r1, int64_t last) {
      at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
          int64_t r = r0;
          for (; r + kBlockRows < r1; r += kBlockRows) panels_f32<kBlockRows>(xp + r * K, wpp, bp, yp + r * N, p, p + 1, K, N);
          for_rows(last, [&](auto rows) { panels_f32<decltype(rows)::value>(xp + r * K, wpp, bp, yp + r * N, p, p + 1, K, N); });
        }
      });
    });
  } else {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); };
    const uint16_t *xp = bits(x), *wpp = bits(wp), *bp = has_bias ? bits(*bias) : nullptr;
    uint16_t* yp = bits(y);
    for_chunks(M, row_block, [&](int64_t r0, int64_t r1, int64_t last) {
      at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
          int64_t r = r0;
          for (; r + kBlockRows < r1; r += kBlockRows) panels_bf16<kBlockRows>(xp + r * K, wpp, bp, yp + r * N, p, p + 1, K, N);
          for_rows(last, [&](auto rows) { panels_bf16<decltype(rows)::value>(xp + r * K, wpp, bp, yp + r * N, p, p + 1, K, N); });
        }
      });
    });
  }
#endif
  return y;
}

// The features the engine allows every kernel (MINISERVE_CPU_FEATURES): a masked one is absent to
// each *_supported check, as it is to the engine.
void allow_cpu_features(bool avx512, bool avx512_bf16) {
#ifdef MINISERVE_X86
  miniserve_simd::allow_avx512().store(avx512);
  miniserve_simd::allow_avx512_bf16().store(avx512_bf16);
#endif
}

}  // namespace

TORCH_LIBRARY(miniserve, m) {
  m.def("gemv(Tensor x, Tensor panels, Tensor? bias, int N, int K, int row_block=64) -> Tensor");
  m.def("gemv_supported(ScalarType dtype) -> bool", &gemv_supported);
  m.def("allow_cpu_features(bool avx512, bool avx512_bf16) -> ()", &allow_cpu_features);
}

TORCH_LIBRARY_IMPL(miniserve, CPU, m) { m.impl("gemv", &gemv); }
