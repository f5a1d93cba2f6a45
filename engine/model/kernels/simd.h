// AVX-512 helpers shared by miniserve's kernels: 16 fp32 lanes loaded from and stored to fp32 or
// bf16 (widened on load, rounded to nearest even on store, as torch rounds), with masked forms
// for a row's last n < 16 elements, and e^x. Functions carry their target attribute, so the
// files build with plain flags and run only where cpu_has_avx512() holds; the few kernels with an
// AVX2 form (MINISERVE_TARGET_AVX2) run where cpu_has_avx2() holds.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <atomic>
#include <cstdint>

#define MINISERVE_X86 1
#define MINISERVE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define MINISERVE_TARGET_AVX2 __attribute__((target("avx2,fma")))

namespace miniserve_simd {

// What the engine allows (MINISERVE_CPU_FEATURES masks features away; engine/model/kernels/
// features.py): set through miniserve::allow_cpu_features after the build. One instance per
// library (inline function statics), read by every *_supported check.
inline std::atomic<bool>& allow_avx2() {
  static std::atomic<bool> allowed{true};
  return allowed;
}
inline std::atomic<bool>& allow_avx512() {
  static std::atomic<bool> allowed{true};
  return allowed;
}
inline std::atomic<bool>& allow_avx512_bf16() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

inline std::atomic<bool>& allow_amx_bf16() {
  static std::atomic<bool> allowed{true};
  return allowed;
}
inline bool cpu_has_avx2() {
  __builtin_cpu_init();
  return allow_avx2().load(std::memory_order_relaxed) && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma");
}

inline bool cpu_has_avx512() {
  __builtin_cpu_init();
  return allow_avx512().load(std::memory_order_relaxed) && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}

// bf16 dot products (vdpbf16ps)
inline bool cpu_has_avx512_bf16() {
  return cpu_has_avx512() && allow_avx512_bf16().load(std::memory_order_relaxed) &&
         __builtin_cpu_supports("avx512bf16");
}

MINISERVE_TARGET inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

MINISERVE_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MINISERVE_TARGET inline __m512 load16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
MINISERVE_TARGET inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
MINISERVE_TARGET inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// v rounded to the precision of T, kept in fp32 lanes: what torch stores for a bf16 result
MINISERVE_TARGET inline __m512 round_to(float*, __m512 v) { return v; }
MINISERVE_TARGET inline __m512 round_to(uint16_t*, __m512 v) {
  // round to nearest even (NaNs do not occur: the inputs are finite)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xFFFF0000u))));
}

MINISERVE_TARGET inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
MINISERVE_TARGET inline void store16(uint16_t* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(round_to(p, v));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
MINISERVE_TARGET inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
MINISERVE_TARGET inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  const __m512i bits = _mm512_castps_si512(round_to(p, v));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// e^x: x = n·ln2 + r with |r| <= ln2/2, e^r by its degree-7 Taylor polynomial (relative error
// < 2e-8, below fp32's rounding), scaled by 2^n; 0 below -104, inf above 88.8 as expf.
MINISERVE_TARGET inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// AVX2 (fp32 only): 8 lanes, masks as vectors of all-ones lanes (maskload never touches a masked
// element, as AVX-512's masked loads)
MINISERVE_TARGET_AVX2 inline __m256i lanes8(int64_t n) {
  const int c = n >= 8 ? 8 : n <= 0 ? 0 : static_cast<int>(n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// The first min(n, 8) floats at p. A whole vector is a plain move: AMD's Zen cores run AVX2's masked
// stores as microcode and its masked loads in extra uops (a masked load and store of a whole vector
// ~15x plain ones on one of them, docs/architecture.md), so only a row's ragged tail pays for the mask.
MINISERVE_TARGET_AVX2 inline __m256 load8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes8(n));
}
MINISERVE_TARGET_AVX2 inline void store8(float* p, __m256 v, int64_t n) {
  if (n >= 8) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, lanes8(n), v);
  }
}
MINISERVE_TARGET_AVX2 inline float reduce_add8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// exp16's e^x in 8 lanes; AVX2 has no scalef, so 2^n is built in the exponent field in two halves
// (n ranges over [-150, 128]: one half would leave the normal range), giving 0 and inf where exp16 does
MINISERVE_TARGET_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 pow1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, pow1), pow2);
}

// silu(x) · up as torch computes silu(gate) * up in T: silu rounded to T before the product (the
// caller's store rounds the product); layer_ops' silu_mul and the gemv's gate_up_silu both use it
template <typename T>
MINISERVE_TARGET inline __m512 silu_times(T* out, __m512 x, __m512 up) {
  const __m512 silu = round_to(out, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(
                                                          _mm512_setzero_ps(), x)))));
  return _mm512_mul_ps(silu, up);
}

// silu_times in 8 lanes (fp32)
MINISERVE_TARGET_AVX2 inline __m256 silu_times8(__m256 x, __m256 up) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), up);
}

}  // namespace miniserve_simd

#endif
