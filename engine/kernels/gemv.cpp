// miniserve::gemv — y (M, N) = x (M, K) · w (N, K)ᵀ + bias, for M of 1 or 2 (a decode of one or two
// requests, the sampled row of a prefill).
//
// Why: a decode step reads every weight once and does almost no arithmetic with it, so its time
// is how fast the weights stream from memory. At one or two rows oneDNN's linear reads the 0.5B
// model's weights at 25-31 GB/s on this 2-core VM, less than at three rows (35-38), while a plain
// sweep of the same bytes reaches 50-60. This kernel walks each thread's contiguous half of w
// front to back, one row at a time (one forward stream the hardware prefetcher keeps ahead of),
// and applies that row to each input row while it is in L1: 40-49 GB/s, 1.5x oneDNN on whole
// decode calls of one request (benchmarks/gemv_kernel.py). fp32 uses FMA, bf16 AVX512-BF16 dot
// products (bf16 products summed in fp32, as oneDNN's bf16 matmul does); the bias is added in
// fp32 and the result rounded once to the input dtype.
//
// Built at first use by engine/kernels/__init__.py (torch.utils.cpp_extension). The kernels are
// compiled for AVX-512 with target attributes and only run where the CPU has it
// (miniserve::gemv_supported); elsewhere the engine keeps oneDNN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MINISERVE_X86 1
#endif

namespace {

// Past two rows oneDNN's blocked kernels win (they reuse each loaded weight across more rows);
// engine/kernels/__init__.py MAX_ROWS mirrors this.
constexpr int64_t kMaxRows = 2;

#ifdef MINISERVE_X86

bool cpu_has(const char* what) {
  __builtin_cpu_init();
  if (what[0] == 'f') return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

// U independent accumulators per input row hide the FMA latency: 4 for one row, 2 for several
template <int M, int U = (M == 1 ? 4 : 2)>
__attribute__((target("avx512f,avx512bw,fma"))) void rows_f32(const float* x, const float* w, const float* bias,
                                                                float* y, int64_t n0, int64_t n1, int64_t K,
                                                                int64_t N) {
  const int64_t body = K / (16 * U) * (16 * U);
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m512 a[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) a[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < body; k += 16 * U) {
      for (int u = 0; u < U; ++u) {
        const __m512 wv = _mm512_loadu_ps(wr + k + 16 * u);
        for (int m = 0; m < M; ++m) a[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k + 16 * u), a[m][u]);
      }
    }
    for (; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      const __m512 wv = _mm512_maskz_loadu_ps(mask, wr + k);
      for (int m = 0; m < M; ++m) a[m][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k), a[m][0]);
    }
    const float b = bias ? bias[n] : 0.0f;
    for (int m = 0; m < M; ++m) {
      for (int u = 1; u < U; ++u) a[m][0] = _mm512_add_ps(a[m][0], a[m][u]);
      y[m * N + n] = _mm512_reduce_add_ps(a[m][0]) + b;
    }
  }
}

template <int M, int U = (M == 1 ? 4 : 2)>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void rows_bf16(const uint16_t* x, const uint16_t* w,
                                                                       const uint16_t* bias, c10::BFloat16* y,
                                                                       int64_t n0, int64_t n1, int64_t K, int64_t N) {
  const int64_t body = K / (32 * U) * (32 * U);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m512 a[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) a[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < body; k += 32 * U) {
      for (int u = 0; u < U; ++u) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * u);
        for (int m = 0; m < M; ++m)
          a[m][u] = _mm512_dpbf16_ps(a[m][u], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u));
      }
    }
    for (; k < K; k += 32) {
      const __mmask32 mask = K - k >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (K - k)) - 1);
      const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
      for (int m = 0; m < M; ++m)
        a[m][0] = _mm512_dpbf16_ps(a[m][0], w0, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
    }
    float b = 0.0f;
    if (bias) b = static_cast<float>(c10::BFloat16(bias[n], c10::BFloat16::from_bits()));
    for (int m = 0; m < M; ++m) {
      for (int u = 1; u < U; ++u) a[m][0] = _mm512_add_ps(a[m][0], a[m][u]);
      y[m * N + n] = c10::BFloat16(_mm512_reduce_add_ps(a[m][0]) + b);  // rounds to nearest even
    }
  }
}

template <typename Fn>
void for_rows(int64_t M, Fn&& fn) {
  if (M == 1) {
    fn(std::integral_constant<int, 1>{});
  } else {
    fn(std::integral_constant<int, 2>{});
  }
}

#endif  // MINISERVE_X86

bool gemv_supported(at::ScalarType dtype) {
#ifdef MINISERVE_X86
  if (dtype == at::kFloat) return cpu_has("f32");
  if (dtype == at::kBFloat16) return cpu_has("bf16");
#endif
  return false;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(gemv_supported(x.scalar_type()), "miniserve::gemv: no kernel for ", x.scalar_type(), " on this CPU");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "miniserve::gemv: x and w must be 2-D");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "miniserve::gemv: x and w must be contiguous");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "miniserve::gemv: x is ", x.scalar_type(), ", w is ",
              w.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "miniserve::gemv: x has ", K, " columns, w has ", w.size(1));
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "miniserve::gemv: 1 to ", kMaxRows, " rows, got ", M);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "miniserve::gemv: bias must be a contiguous (", N, ",) tensor of x's dtype");
  }
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef MINISERVE_X86
  // contiguous halves of w per thread: each thread reads one forward stream
  const int64_t grain = std::max<int64_t>(64, N / std::max(1, at::get_num_threads()));
  if (x.scalar_type() == at::kFloat) {
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *bp = has_bias ? bias->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    for_rows(M, [&](auto rows) {
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows_f32<decltype(rows)::value>(xp, wp, bp, yp, n0, n1, K, N); });
    });
  } else {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>()); };
    const uint16_t *xp = bits(x), *wp = bits(w), *bp = has_bias ? bits(*bias) : nullptr;
    c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
    for_rows(M, [&](auto rows) {
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows_bf16<decltype(rows)::value>(xp, wp, bp, yp, n0, n1, K, N); });
    });
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(miniserve, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemv_supported(ScalarType dtype) -> bool", &gemv_supported);
}

TORCH_LIBRARY_IMPL(miniserve, CPU, m) { m.impl("gemv", &gemv); }
