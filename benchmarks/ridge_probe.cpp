// The ridge probe for benchmarks/ridge_probe.py: a stream of weights read once, each 64-byte vector
// multiplied into `rows` rows' accumulators by FMAs (bf16: AVX512-BF16 dot products) with the
// multiplier in a register: the arithmetic of a `rows`-row product and its weight stream, with
// nothing else (no x loads, no panels' sums to store, no calls). What it reaches is this machine's
// own limit for a product that needs its memory and its arithmetic at once. On a CPU with AVX2 but
// no AVX-512 (or with AVX-512 masked off) the fp32 loop runs in 256-bit vectors: a step's four
// vectors go into each row's one accumulator (8 rows: 8 chains, more than an FMA's latency needs
// in flight; 16 rows: the 8 twice, with a second multiplier), so the loop stays in 16 registers.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace {

template <int M>
__attribute__((target("avx512f,fma"))) float stream_f32(const float* p, int64_t steps) {
  __m512 a0[M], a1[M];  // each row's sums start apart, so no compiler may fold the rows into one
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_set1_ps(static_cast<float>(m));
  const __m512 x = _mm512_set1_ps(1.0f);
  for (int64_t k = 0; k < steps; ++k) {  // a step: 128 bytes, two vectors
    const __m512 w0 = _mm512_loadu_ps(p + k * 32), w1 = _mm512_loadu_ps(p + k * 32 + 16);
    for (int m = 0; m < M; ++m) {
      a0[m] = _mm512_fmadd_ps(w0, x, a0[m]);
      a1[m] = _mm512_fmadd_ps(w1, x, a1[m]);
    }
  }
  __m512 s = _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) s = _mm512_add_ps(s, _mm512_add_ps(a0[m], a1[m]));
  return _mm512_reduce_add_ps(s);
}

template <int M>
__attribute__((target("avx2,fma"))) float stream_f32_avx2(const float* p, int64_t steps) {
  constexpr int A = M < 8 ? 4 : 8;  // accumulators: one row's four vectors apart, else one per row
  __m256 a[A];
  for (int m = 0; m < A; ++m) a[m] = _mm256_set1_ps(static_cast<float>(m));
  const __m256 x = _mm256_set1_ps(1.0f), x2 = _mm256_set1_ps(0.5f);
  for (int64_t k = 0; k < steps; ++k) {  // a step: 128 bytes, four vectors
    __m256 w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm256_loadu_ps(p + k * 32 + 8 * j);
    if constexpr (M < 8) {
      for (int j = 0; j < 4; ++j) a[j] = _mm256_fmadd_ps(w[j], x, a[j]);
    } else {
      for (int j = 0; j < 4; ++j) {
        for (int m = 0; m < 8; ++m) a[m] = _mm256_fmadd_ps(w[j], x, a[m]);
        if constexpr (M == 16) {
          for (int m = 0; m < 8; ++m) a[m] = _mm256_fmadd_ps(w[j], x2, a[m]);
        }
      }
    }
  }
  __m256 s = _mm256_setzero_ps();
  for (int m = 0; m < A; ++m) s = _mm256_add_ps(s, a[m]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

template <int M>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) float stream_bf16(const uint16_t* p, int64_t steps) {
  __m512 a0[M], a1[M];  // as stream_f32's
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_set1_ps(static_cast<float>(m));
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // (1.0, 1.0) in bf16
  for (int64_t k = 0; k < steps; ++k) {  // a step: 128 bytes, two vectors of 16 pairs
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p + k * 64), w1 = (__m512bh)_mm512_loadu_si512(p + k * 64 + 32);
    for (int m = 0; m < M; ++m) {
      a0[m] = _mm512_dpbf16_ps(a0[m], w0, x);
      a1[m] = _mm512_dpbf16_ps(a1[m], w1, x);
    }
  }
  __m512 s = _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) s = _mm512_add_ps(s, _mm512_add_ps(a0[m], a1[m]));
  return _mm512_reduce_add_ps(s);
}

template <typename T, typename Fn>
float stream_rows(const T* p, int64_t steps, int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{}, p, steps);
    case 8: return fn(std::integral_constant<int, 8>{}, p, steps);
    default: return fn(std::integral_constant<int, 16>{}, p, steps);
  }
}

}  // namespace

// chunks: the weights (fp32 or bf16, each a whole number of 128-byte steps read), streamed as one
// sequence, each thread a contiguous share; rows: 1, 8 or 16; wide: fp32 in AVX-512 (else AVX2).
// Returns the sums (so nothing is optimised away).
double stream_fma(const std::vector<at::Tensor>& chunks, int64_t rows, bool wide) {
  TORCH_CHECK(rows == 1 || rows == 8 || rows == 16, "ridge probe: rows must be 1, 8 or 16, got ", rows);
  TORCH_CHECK(!chunks.empty(), "ridge probe: no weights");
  const bool bf16 = chunks[0].scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16   ? __builtin_cpu_supports("avx512bf16")
              : wide ? __builtin_cpu_supports("avx512f")
                     : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "ridge probe: needs AVX2 and FMA (wide: AVX-512; bf16: AVX512-BF16)");
  std::vector<int64_t> steps;
  int64_t total = 0;
  for (const auto& c : chunks) {
    TORCH_CHECK(c.is_contiguous() && c.scalar_type() == chunks[0].scalar_type(), "ridge probe: contiguous, one dtype");
    steps.push_back(c.numel() * c.element_size() / 128);
    total += steps.back();
  }
  const int64_t threads = std::max(1, at::get_num_threads());
  std::vector<double> sums(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = total * t / threads, hi = total * (t + 1) / threads;
      int64_t at = 0;
      for (size_t i = 0; i < chunks.size(); at += steps[i], ++i) {
        const int64_t a = std::max(lo, at), b = std::min(hi, at + steps[i]);
        if (a >= b) continue;
        const char* base = static_cast<const char*>(chunks[i].data_ptr()) + (a - at) * 128;
        sums[t] += bf16 ? stream_rows(reinterpret_cast<const uint16_t*>(base), b - a, rows,
                                      [](auto m, auto p, auto n) { return stream_bf16<decltype(m)::value>(p, n); })
                 : wide ? stream_rows(reinterpret_cast<const float*>(base), b - a, rows,
                                      [](auto m, auto p, auto n) { return stream_f32<decltype(m)::value>(p, n); })
                        : stream_rows(reinterpret_cast<const float*>(base), b - a, rows, [](auto m, auto p, auto n) {
                            return stream_f32_avx2<decltype(m)::value>(p, n);
                          });
      }
    }
  });
  double s = 0;
  for (double v : sums) s += v;
  return s;
}

#else
double stream_fma(const std::vector<at::Tensor>&, int64_t, bool) {
  TORCH_CHECK(false, "ridge probe: needs an x86-64 CPU with AVX2 (bf16: AVX512-BF16)");
  return 0;
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("stream_fma", &stream_fma); }
