// miniserve's fused layer ops: what a Qwen2 or Qwen3 decoder layer does between its matrix products, in
// three calls instead of ~30 torch ops.
//
// Why: once the products run at memory speed (gemv.cpp) and attention reads each request's keys
// once (decode_attention.cpp), the rest of a layer is small elementwise work spread over ~30 torch
// ops (RMSNorm alone is 8), each a dispatch from Python and a pass over memory: ~19% of a B=1 and
// of a B=32 fp32 decode call. Each op here is one pass, and rounds where the stock modules round,
// so bf16 results round at the same points as stock transformers:
// - add_rms_norm: h += delta (the residual add, in place), then RMSNorm(h) · weight, as
//   Qwen2RMSNorm: fp32 mean of squares, x · rsqrt(mean + eps) rounded to the dtype, times weight.
// - silu_mul: silu(gate) · up over the fused gate/up projection's two halves (silu rounded to the
//   dtype, then the product), as Qwen2MLP.
// - rotary_kv: rotary embedding of a step's q and k heads straight out of the fused qkv projection
//   ((x · cos) + (rotate_half(x) · sin), each product rounded), k and v written into their KV slots,
//   q returned as (tokens, heads, D). Given q_norm and k_norm (Qwen3), each q and k head is first
//   RMS-normalised over its D values as add_rms_norm does a row (Qwen3Attention's q_norm / k_norm,
//   applied after the projection and before the rotation), in the same pass.
// Only the order of the sum of squares and exp's polynomial (simd.h) differ from torch's: logits
// move by rounding (tests hold them to the unbatched reference at 1e-5 in fp32). fp32 also runs on
// AVX2 alone (the *_avx2 forms), where bf16 stays on torch's ops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>

#include "ops.h"
#include "simd.h"

namespace {

#ifdef MINISERVE_X86

using namespace miniserve_simd;

template <typename T>
MINISERVE_TARGET void add_rms_norm_rows(T* h, const T* delta, const T* w, T* x, int64_t r0, int64_t r1, int64_t n,
                                        float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    T* hr = h + r * n;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(n - i);
      __m512 v = load16(hr + i, m);
      if (delta) {  // the residual add, rounded to the dtype as stock rounds h
        v = round_to(hr, _mm512_add_ps(v, load16(delta + r * n + i, m)));
        store16(hr + i, v, m);
      }
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(n - i);
      const __m512 xn = round_to(hr, _mm512_mul_ps(load16(hr + i, m), _mm512_set1_ps(inv)));
      store16(x + r * n + i, _mm512_mul_ps(load16(w + i, m), xn), m);
    }
  }
}

// one head: y = RMSNorm(x) · w over its D values, rounded as add_rms_norm_rows rounds; y may be x
template <typename T>
MINISERVE_TARGET inline void rms_norm_head(const T* x, const T* w, T* y, int64_t D, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 v = load16(x + i, lanes(D - i));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; i += 16) {
    const __mmask16 m = lanes(D - i);
    const __m512 xn = round_to(y, _mm512_mul_ps(load16(x + i, m), _mm512_set1_ps(inv)));
    store16(y + i, _mm512_mul_ps(load16(w + i, m), xn), m);
  }
}

template <typename T>
MINISERVE_TARGET void silu_mul_rows(const T* gu, T* out, int64_t r0, int64_t r1, int64_t inter) {
  // four vectors per step: each is one long chain of dependent operations (exp's polynomial, the
  // division, two roundings), and side by side in the program the out-of-order core overlaps them
  // (one at a time it ran at about a third of the arithmetic's rate)
  constexpr int kVecs = 4;
  for (int64_t r = r0; r < r1; ++r) {
    const T *g = gu + r * 2 * inter, *u = g + inter;
    T* o = out + r * inter;
    int64_t i = 0;
    for (; i + 16 * kVecs <= inter; i += 16 * kVecs) {
      __m512 x[kVecs], y[kVecs];
      for (int j = 0; j < kVecs; ++j) x[j] = load16(g + i + 16 * j);
      for (int j = 0; j < kVecs; ++j) y[j] = silu_times(out, x[j], load16(u + i + 16 * j));
      for (int j = 0; j < kVecs; ++j) store16(o + i + 16 * j, y[j]);
    }
    for (; i < inter; i += 16) {
      const __mmask16 m = lanes(inter - i);
      store16(o + i, silu_times(out, load16(g + i, m), load16(u + i, m)), m);
    }
  }
}

// one head of one token: y = (x · cos) + (rotate_half(x) · sin), each product rounded to T; y may
// be x (each step reads both halves' values before writing them)
template <typename T>
MINISERVE_TARGET inline void rotate(const T* x, const T* cos, const T* sin, T* y, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = lanes(half - i);
    const __m512 x1 = load16(x + i, m), x2 = load16(x + half + i, m);
    const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
    store16(y + i, _mm512_add_ps(round_to(y, _mm512_mul_ps(x1, load16(cos + i, m))),
                                 round_to(y, _mm512_mul_ps(neg_x2, load16(sin + i, m)))), m);
    store16(y + half + i, _mm512_add_ps(round_to(y, _mm512_mul_ps(x2, load16(cos + half + i, m))),
                                        round_to(y, _mm512_mul_ps(x1, load16(sin + half + i, m)))), m);
  }
}

template <typename T>
MINISERVE_TARGET void rotary_kv_tokens(const T* qkv, const T* cos, const T* sin, T* q, T* ks, T* vs,
                                       const int64_t* slots, const int64_t* positions, int64_t t0, int64_t t1,
                                       int64_t H, int64_t KVH, int64_t D, int64_t max_len, const T* qn,
                                       const T* kn, float eps) {
  const int64_t width = (H + 2 * KVH) * D;
  for (int64_t t = t0; t < t1; ++t) {
    const T *x = qkv + t * width, *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < H; ++h) {
      T* y = q + (t * H + h) * D;
      if (qn) {  // normalised into the output, then rotated there
        rms_norm_head(x + h * D, qn, y, D, eps);
        rotate(y, c, s, y, D);
      } else {
        rotate(x + h * D, c, s, y, D);
      }
    }
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t at = ((slots[t] * KVH + h) * max_len + positions[t]) * D;
      if (kn) {
        rms_norm_head(x + (H + h) * D, kn, ks + at, D, eps);
        rotate(ks + at, c, s, ks + at, D);
      } else {
        rotate(x + (H + h) * D, c, s, ks + at, D);
      }
      const T* v = x + (H + KVH + h) * D;
      for (int64_t i = 0; i < D; i += 16) store16(vs + at + i, load16(v + i, lanes(D - i)), lanes(D - i));
    }
  }
}

// The same three in AVX2, fp32 only (an AVX2-only CPU runs fp32: model.dtype=auto picks it there).
// fp32 rounds nowhere between the steps, so each is the AVX-512 form's arithmetic 8 lanes at a time.
MINISERVE_TARGET_AVX2 void add_rms_norm_rows_avx2(float* h, const float* delta, const float* w, float* x, int64_t r0,
                                                  int64_t r1, int64_t n, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    float* hr = h + r * n;
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const int64_t m = n - i;
      __m256 v = load8(hr + i, m);
      if (delta) {
        v = _mm256_add_ps(v, load8(delta + r * n + i, m));
        store8(hr + i, v, m);
      }
      ss = _mm256_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(reduce_add8(ss) / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; i += 8) {
      const int64_t m = n - i;
      const __m256 xn = _mm256_mul_ps(load8(hr + i, m), _mm256_set1_ps(inv));
      store8(x + r * n + i, _mm256_mul_ps(load8(w + i, m), xn), m);
    }
  }
}

MINISERVE_TARGET_AVX2 inline void rms_norm_head_avx2(const float* x, const float* w, float* y, int64_t D, float eps) {
  __m256 ss = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 v = load8(x + i, D - i);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  const float inv = 1.0f / std::sqrt(reduce_add8(ss) / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; i += 8) {
    const int64_t m = D - i;
    store8(y + i, _mm256_mul_ps(load8(w + i, m), _mm256_mul_ps(load8(x + i, m), _mm256_set1_ps(inv))), m);
  }
}

MINISERVE_TARGET_AVX2 void silu_mul_rows_avx2(const float* gu, float* out, int64_t r0, int64_t r1, int64_t inter) {
  constexpr int kVecs = 4;  // as silu_mul_rows: independent chains side by side
  for (int64_t r = r0; r < r1; ++r) {
    const float *g = gu + r * 2 * inter, *u = g + inter;
    float* o = out + r * inter;
    int64_t i = 0;
    for (; i + 8 * kVecs <= inter; i += 8 * kVecs) {
      __m256 y[kVecs];
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) y[j] = silu_times8(_mm256_loadu_ps(g + i + 8 * j), _mm256_loadu_ps(u + i + 8 * j));
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) _mm256_storeu_ps(o + i + 8 * j, y[j]);
    }
    for (; i < inter; i += 8) {
      const int64_t m = inter - i;
      store8(o + i, silu_times8(load8(g + i, m), load8(u + i, m)), m);
    }
  }
}

MINISERVE_TARGET_AVX2 inline void rotate_avx2(const float* x, const float* cos, const float* sin, float* y, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const int64_t m = half - i;
    const __m256 x1 = load8(x + i, m), x2 = load8(x + half + i, m);
    const __m256 neg_x2 = _mm256_sub_ps(_mm256_setzero_ps(), x2);
    store8(y + i, _mm256_add_ps(_mm256_mul_ps(x1, load8(cos + i, m)), _mm256_mul_ps(neg_x2, load8(sin + i, m))), m);
    store8(y + half + i,
           _mm256_add_ps(_mm256_mul_ps(x2, load8(cos + half + i, m)), _mm256_mul_ps(x1, load8(sin + half + i, m))), m);
  }
}

MINISERVE_TARGET_AVX2 void rotary_kv_tokens_avx2(const float* qkv, const float* cos, const float* sin, float* q,
                                                 float* ks, float* vs, const int64_t* slots, const int64_t* positions,
                                                 int64_t t0, int64_t t1, int64_t H, int64_t KVH, int64_t D,
                                                 int64_t max_len, const float* qn, const float* kn, float eps) {
  const int64_t width = (H + 2 * KVH) * D;
  for (int64_t t = t0; t < t1; ++t) {
    const float *x = qkv + t * width, *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < H; ++h) {
      float* y = q + (t * H + h) * D;
      if (qn) {
        rms_norm_head_avx2(x + h * D, qn, y, D, eps);
        rotate_avx2(y, c, s, y, D);
      } else {
        rotate_avx2(x + h * D, c, s, y, D);
      }
    }
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t at = ((slots[t] * KVH + h) * max_len + positions[t]) * D;
      if (kn) {
        rms_norm_head_avx2(x + (H + h) * D, kn, ks + at, D, eps);
        rotate_avx2(ks + at, c, s, ks + at, D);
      } else {
        rotate_avx2(x + (H + h) * D, c, s, ks + at, D);
      }
      const float* v = x + (H + KVH + h) * D;
      for (int64_t i = 0; i < D; i += 8) store8(vs + at + i, load8(v + i, D - i), D - i);
    }
  }
}

// runs fn(T*-typed pointers' type) for fp32 or bf16
template <typename Fn>
void by_dtype(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else {
    fn(uint16_t{});
  }
}

#endif  // MINISERVE_X86

bool layer_ops_supported(at::ScalarType dtype) {
#ifdef MINISERVE_X86
  return ((dtype == at::kFloat || dtype == at::kBFloat16) && cpu_has_avx512()) ||
         (dtype == at::kFloat && cpu_has_avx2());
#else
  return false;
#endif
}

void check_rows(const char* op, const at::Tensor& t, const char* name, int64_t cols, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, op, name, " is ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(layer_ops_supported(t.scalar_type()), op, "no kernel for ", t.scalar_type(), " on this CPU");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && (cols < 0 || t.size(1) == cols), op, name,
              " must be a contiguous (rows, ", cols < 0 ? t.size(-1) : cols, ") tensor, got ", t.sizes());
}

int64_t grain(int64_t row_work) {  // rows per thread task: ~16k elements, at least one row
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_work));
}

}  // namespace

namespace miniserve_ops {

at::Tensor add_rms_norm(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  const char* op = "miniserve::add_rms_norm: ";
  check_rows(op, h, "h", -1, h.scalar_type());
  const int64_t rows = h.size(0), n = h.size(1);
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta) {
    check_rows(op, *delta, "delta", n, h.scalar_type());
    TORCH_CHECK(delta->size(0) == rows, op, "delta has ", delta->size(0), " rows, h ", rows);
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous() &&
                  weight.scalar_type() == h.scalar_type(),
              op, "weight must be a contiguous (", n, ",) tensor of h's dtype");
  at::Tensor x = at::empty_like(h);
#ifdef MINISERVE_X86
  if (h.scalar_type() == at::kFloat && !cpu_has_avx512()) {  // AVX2, fp32
    float *hp = ptr<float>(h), *xp = ptr<float>(x);
    const float* dp = has_delta ? ptr<float>(*delta) : nullptr;
    at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
      add_rms_norm_rows_avx2(hp, dp, ptr<float>(weight), xp, r0, r1, n, static_cast<float>(eps));
    });
    return x;
  }
  by_dtype(h.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    T *hp = ptr<T>(h), *xp = ptr<T>(x);
    const T* dp = has_delta ? ptr<T>(*delta) : nullptr;
    at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
      add_rms_norm_rows(hp, dp, ptr<T>(weight), xp, r0, r1, n, static_cast<float>(eps));
    });
  });
#endif
  return x;
}

at::Tensor silu_mul(const at::Tensor& gu, int64_t inter) {
  const char* op = "miniserve::silu_mul: ";
  check_rows(op, gu, "gate/up", 2 * inter, gu.scalar_type());
  TORCH_CHECK(inter >= 1, op, "inter must be positive");
  const int64_t rows = gu.size(0);
  at::Tensor out = at::empty({rows, inter}, gu.options());
#ifdef MINISERVE_X86
  if (gu.scalar_type() == at::kFloat && !cpu_has_avx512()) {  // AVX2, fp32
    at::parallel_for(0, rows, grain(inter), [&](int64_t r0, int64_t r1) {
      silu_mul_rows_avx2(ptr<float>(gu), ptr<float>(out), r0, r1, inter);
    });
    return out;
  }
  by_dtype(gu.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, rows, grain(inter), [&](int64_t r0, int64_t r1) {
      silu_mul_rows(ptr<T>(gu), ptr<T>(out), r0, r1, inter);
    });
  });
#endif
  return out;
}

at::Tensor rotary_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                     int64_t kv_heads, const at::Tensor& k_store, const at::Tensor& v_store, const at::Tensor& slots,
                     const at::Tensor& positions, const std::optional<at::Tensor>& q_norm,
                     const std::optional<at::Tensor>& k_norm, double eps) {
  const char* op = "miniserve::rotary_kv: ";
  TORCH_CHECK(k_store.dim() == 4 && k_store.sizes() == v_store.sizes() && k_store.size(1) == kv_heads, op,
              "the stores must be two (slots, ", kv_heads, ", max_len, D) tensors");
  const int64_t D = k_store.size(3), num_slots = k_store.size(0), max_len = k_store.size(2);
  TORCH_CHECK(D % 2 == 0 && heads >= 1 && kv_heads >= 1, op, "bad head counts or head dim");
  const auto dtype = qkv.scalar_type();
  check_rows(op, qkv, "qkv", (heads + 2 * kv_heads) * D, dtype);
  const int64_t T = qkv.size(0);
  check_rows(op, cos, "cos", D, dtype);
  check_rows(op, sin, "sin", D, dtype);
  TORCH_CHECK(cos.size(0) == T && sin.size(0) == T, op, "cos and sin need one row per token");
  TORCH_CHECK(k_store.scalar_type() == dtype && v_store.scalar_type() == dtype && k_store.is_contiguous() &&
                  v_store.is_contiguous(),
              op, "the stores must be contiguous and of qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && slots.dim() == 1 &&
                  positions.dim() == 1 && slots.size(0) == T && positions.size(0) == T && slots.is_contiguous() &&
                  positions.is_contiguous(),
              op, "slots and positions must be contiguous int64 (tokens,) tensors");
  const bool has_qn = q_norm.has_value() && q_norm->defined(), has_kn = k_norm.has_value() && k_norm->defined();
  TORCH_CHECK(has_qn == has_kn, op, "q_norm and k_norm come together");
  for (const auto* w : {has_qn ? &*q_norm : nullptr, has_kn ? &*k_norm : nullptr}) {
    TORCH_CHECK(!w || (w->dim() == 1 && w->size(0) == D && w->is_contiguous() && w->scalar_type() == dtype), op,
                "q_norm and k_norm must be contiguous (", D, ",) tensors of qkv's dtype");
  }
  const int64_t *sp = slots.data_ptr<int64_t>(), *pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots && pp[t] >= 0 && pp[t] < max_len, op, "token ", t,
                " writes slot ", sp[t], " position ", pp[t], "; the stores hold ", num_slots, " slots of ", max_len);
  }
  at::Tensor q = at::empty({T, heads, D}, qkv.options());
#ifdef MINISERVE_X86
  if (dtype == at::kFloat && !cpu_has_avx512()) {  // AVX2, fp32
    const float* qn = has_qn ? ptr<float>(*q_norm) : nullptr;
    const float* kn = has_kn ? ptr<float>(*k_norm) : nullptr;
    at::parallel_for(0, T, grain((heads + 2 * kv_heads) * D), [&](int64_t t0, int64_t t1) {
      rotary_kv_tokens_avx2(ptr<float>(qkv), ptr<float>(cos), ptr<float>(sin), ptr<float>(q), ptr<float>(k_store),
                            ptr<float>(v_store), sp, pp, t0, t1, heads, kv_heads, D, max_len, qn, kn,
                            static_cast<float>(eps));
    });
    return q;
  }
  by_dtype(dtype, [&](auto zero) {
    using U = decltype(zero);
    const U* qn = has_qn ? ptr<U>(*q_norm) : nullptr;
    const U* kn = has_kn ? ptr<U>(*k_norm) : nullptr;
    at::parallel_for(0, T, grain((heads + 2 * kv_heads) * D), [&](int64_t t0, int64_t t1) {
      rotary_kv_tokens(ptr<U>(qkv), ptr<U>(cos), ptr<U>(sin), ptr<U>(q), ptr<U>(k_store), ptr<U>(v_store), sp, pp,
                       t0, t1, heads, kv_heads, D, max_len, qn, kn, static_cast<float>(eps));
    });
  });
#endif
  return q;
}

}  // namespace miniserve_ops

TORCH_LIBRARY_FRAGMENT(miniserve, m) {
  m.def("add_rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu, int inter) -> Tensor");
  m.def("rotary_kv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(a!) k_store, "
        "Tensor(b!) v_store, Tensor slots, Tensor positions, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float eps=0.0) -> Tensor");
  m.def("layer_ops_supported(ScalarType dtype) -> bool", &layer_ops_supported);
}

TORCH_LIBRARY_IMPL(miniserve, CPU, m) {
  m.impl("add_rms_norm", &miniserve_ops::add_rms_norm);
  m.impl("silu_mul", &miniserve_ops::silu_mul);
  m.impl("rotary_kv", &miniserve_ops::rotary_kv);
}
