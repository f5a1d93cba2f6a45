// miniserve::decode_attention — rows of one query token each against keys 0..len-1 of that row's
// own KV slot: a packed step's decodes (one row per request) and every token of its prefill chunks
// (token j of a chunk at context c is a row of its slot seeing c + j + 1 keys, which is causal
// attention), all in one call.
//
// Why: torch's CPU SDPA treats each (request, KV head) as a tiny flash-attention problem (7 query
// heads sharing a KV head become a 7-row query) and runs it through its blocked GEMM path, which
// at decode sizes costs several times the time it takes to read the keys and values once, and on
// a prefill chunk runs well below the CPU's FMA rate (docs/architecture.md has the figures). Here
// each (row, KV head) is one task: its keys are read once, row by row, into registers and dotted
// with every query head of its group (one horizontal sum per score); the softmax runs over all of
// that row's scores (vectorised exp); its values are read once and accumulated, with the group's
// outputs held in registers. Only the row's own keys 0..len-1 are read, so nothing is masked and
// nothing past a row's length is touched; a chunk's rows share their slot's keys, which stay in
// cache from one row to the next. Arithmetic is in fp32 whatever the cache dtype (bf16 keys and
// values are widened on load; the output is rounded once), as SDPA's CPU kernel accumulates;
// where the CPU has AVX512-BF16 (and the mask allows it), bf16 scores are instead bf16 dot
// products over pairs of dimensions, each product exact in fp32 as before, summed in fp32 in
// another order (scores_of_dp: a block of 16 keys transposed once, no sums across lanes), and the
// value pass rounds the probabilities to bf16, as SDPA's CPU flash kernel does before its value
// product, and takes two keys per dot product (values_of_dp): half the value pass's instructions.
//
// Shapes: q (rows, heads, D); k_store, v_store (slots, kv_heads, max_len, D) as SlotKVCache keeps
// them; slots, lens (rows,) int64: the slot of each row and how many keys it sees. D a multiple of
// 16 up to 128 (Qwen: 64, 128). Tasks are (row, KV head) pairs spread over torch's threads.
//
// A decode's keys and values are two fresh streams from memory per task (a step's KV outgrows the
// L3), so a task asks for its values while it dots its keys and for the next task's keys while it
// sums its values: each stream is on its way before it is read, where each used to start with a
// wait for memory (24 layers of 32 decodes at 257 keys: 0.88x the time in fp32, 0.65x in bf16).
// A prefill chunk's rows share their slot's keys and values, in cache after its first row: they
// ask for nothing.
//
// Where the CPU has AVX2 but no AVX-512, fp32 runs the same three passes in 8 lanes
// (attend_task_avx2): the scores go three heads × four keys at a time (12 accumulators; each key
// loaded once for the three), and 16 registers hold 12 value accumulators, so a group of heads
// takes several passes over its values, which go in 16 KB blocks that stay in L1 for every pass
// (each output's sum still in key order). It asks for the same streams ahead as the AVX-512 form,
// a decode's values while its keys are dotted and the next task's keys a share per value pass.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

constexpr int kAccRegisters = 28;  // output accumulators a value pass may hold (of 32 zmm)

#ifdef MINISERVE_X86

using namespace miniserve_simd;

// `bytes` at `at` asked for into L2, a cache line at a time: a block of a task's values, while its
// keys are dotted (a task's values outgrow L1)
inline void values_to_l2(const void* at, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(at) + i, _MM_HINT_T1);
}

// r[i] = Σ lanes of a[i], for 16 vectors: pairwise sums through 4 levels of shuffles (45 ops for 16
// sums; one _mm512_reduce_add_ps per score costs 8)
MINISERVE_TARGET inline __m512 sum16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lane: (a2i: 0+2, a2i+1: 0+2, a2i: 1+3, a2i+1: 1+3)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 128-bit lane: the lane's sums of a4i .. a4i+3
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // (a8i..+3: lanes 0+1, lanes 2+3, a8i+4..+7: lanes 0+1, lanes 2+3)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// scores[g][j] = q[g] · k[j] (q already scaled) for the group's G heads and keys 0..L-1. Keys go in
// blocks of 16 (4 KB at D = 64, held in L1 across the group's heads); for each head the 16 dot
// products stay 16-lane vectors until one transposing sum turns them into 16 scores.
template <int NC, typename T>
MINISERVE_TARGET void scores_of(const float* q, const T* k, const T* v, int64_t L, int G, float* scores) {
  int64_t j0 = 0;
  for (; j0 + 16 <= L; j0 += 16) {
    if (v) values_to_l2(v + j0 * NC * 16, 16 * NC * 16 * sizeof(T));  // with `v`, the block's values
    const float* kb;
    alignas(64) float widened[std::is_same_v<T, float> ? 1 : 16 * NC * 16];
    if constexpr (std::is_same_v<T, float>) {
      kb = k + j0 * NC * 16;
    } else {  // widen the block's bf16 keys once, not once per head
      for (int i = 0; i < 16 * NC; ++i) _mm512_store_ps(widened + i * 16, load16(k + j0 * NC * 16 + i * 16));
      kb = widened;
    }
    for (int g = 0; g < G; ++g) {
      __m512 qg[NC], acc[16];
      for (int c = 0; c < NC; ++c) qg[c] = _mm512_loadu_ps(q + g * NC * 16 + c * 16);
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_mul_ps(qg[0], load16(kb + j * NC * 16));
        for (int c = 1; c < NC; ++c) acc[j] = _mm512_fmadd_ps(qg[c], load16(kb + j * NC * 16 + c * 16), acc[j]);
      }
      _mm512_storeu_ps(scores + g * L + j0, sum16(acc));
    }
  }
  for (int64_t j = j0; j < L; ++j) {  // the last L % 16 keys, one at a time
    __m512 kj[NC];
    for (int c = 0; c < NC; ++c) kj[c] = load16(k + j * NC * 16 + c * 16);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(kj[0], _mm512_loadu_ps(q + g * NC * 16));
      for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(kj[c], _mm512_loadu_ps(q + g * NC * 16 + c * 16), acc);
      scores[g * L + j] = _mm512_reduce_add_ps(acc);
    }
  }
}

#define MINISERVE_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))

// t[p] (16 dwords) = dword p of rows 0..15 of a 16 × 16 block of dwords (rows 16 dwords apart)
MINISERVE_TARGET inline void transpose16(const __m512i* r, __m512i* t) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: dwords of rows i, i+1 interleaved
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads of rows i..i+3 per dword of a 128-bit lane
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  // b[4m + c] lane l (128-bit) holds dword (4l + c) of rows 4m..4m+3; gather lanes across m
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), x1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88), y1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);       // lane 0: dword c
    t[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);   // lane 2: dword 8 + c
    t[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);   // lane 1: dword 4 + c
    t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);  // lane 3: dword 12 + c
  }
}

// H heads' scores against one block of 16 keys from their transposed k pairs kt (pairs × 16):
// s[g][j] = scale · Σ_p q[g] pair p · key j pair p, two partial sums per head (even and odd pairs)
template <int NC, int H>
MINISERVE_TARGET_BF16 void block_scores_dp(const uint16_t* q, const __m512i* kt, float scale, int64_t L, int g0,
                                           float* scores, int64_t j0, __mmask16 keep) {
  constexpr int kPairs = NC * 8;
  __m512 a0[H], a1[H];
  for (int h = 0; h < H; ++h) a0[h] = a1[h] = _mm512_setzero_ps();
  for (int p = 0; p < kPairs; p += 2) {
    for (int h = 0; h < H; ++h) {
      uint32_t q0, q1;
      std::memcpy(&q0, q + (g0 + h) * NC * 16 + 2 * p, 4);
      std::memcpy(&q1, q + (g0 + h) * NC * 16 + 2 * p + 2, 4);
      a0[h] = _mm512_dpbf16_ps(a0[h], (__m512bh)kt[p], (__m512bh)_mm512_set1_epi32(static_cast<int>(q0)));
      a1[h] = _mm512_dpbf16_ps(a1[h], (__m512bh)kt[p + 1], (__m512bh)_mm512_set1_epi32(static_cast<int>(q1)));
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int h = 0; h < H; ++h)
    _mm512_mask_storeu_ps(scores + (g0 + h) * L + j0, keep, _mm512_mul_ps(_mm512_add_ps(a0[h], a1[h]), sc));
}

// scores_of for bf16 on CPUs with AVX512-BF16 (D a multiple of 32): q · k by bf16 dot products
// over pairs of dimensions (each product exact in fp32, as the widened FMAs; only the order of the
// sum differs), then times the scale. A block of 16 keys is transposed once (16 keys side by side
// per pair of dimensions), so each head's 16 scores build up in one vector with no sums across
// lanes, and the keys are not widened.
template <int NC>
MINISERVE_TARGET_BF16 void scores_of_dp(const uint16_t* q, float scale, const uint16_t* k, const uint16_t* v,
                                        int64_t L, int G, float* scores) {
  static_assert(NC % 2 == 0, "pairs of dimensions: D a multiple of 32");
  constexpr int kPairs = NC * 8, kRowVecs = NC / 2;  // dwords (k pairs) per key, 512-bit vectors per key
  constexpr int kHeads = 8;  // heads per pass: 16 accumulators
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - j0);
    if (v && n == 16) values_to_l2(v + j0 * NC * 16, 16 * NC * 16 * 2);
    __m512i kt[kPairs];
    for (int c = 0; c < kRowVecs; ++c) {  // dwords 16c..16c+15 of the 16 keys
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j < n ? _mm512_loadu_si512(k + (j0 + j) * NC * 16 + c * 32) : _mm512_setzero_si512();
      transpose16(r, kt + 16 * c);
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    int g = 0;
    for (; g + kHeads <= G; g += kHeads) block_scores_dp<NC, kHeads>(q, kt, scale, L, g, scores, j0, keep);
    switch (G - g) {
      case 0: break;
      case 1: block_scores_dp<NC, 1>(q, kt, scale, L, g, scores, j0, keep); break;
      case 2: block_scores_dp<NC, 2>(q, kt, scale, L, g, scores, j0, keep); break;
      case 3: block_scores_dp<NC, 3>(q, kt, scale, L, g, scores, j0, keep); break;
      case 4: block_scores_dp<NC, 4>(q, kt, scale, L, g, scores, j0, keep); break;
      case 5: block_scores_dp<NC, 5>(q, kt, scale, L, g, scores, j0, keep); break;
      case 6: block_scores_dp<NC, 6>(q, kt, scale, L, g, scores, j0, keep); break;
      default: block_scores_dp<NC, 7>(q, kt, scale, L, g, scores, j0, keep); break;
    }
  }
}

// scores become e^(s - max) in place, one row per head; inv_sum[g] = 1 / Σ_j of row g
MINISERVE_TARGET void softmax_rows(float* scores, int64_t L, int G, float* inv_sum) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (L % 16)) - 1);
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * L;
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    if (tail) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, s + j));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= L; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx));
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mx));
      _mm512_mask_storeu_ps(s + j, tail, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
}

// out[g] = inv_sum[g] · Σ_j p[g][j] · v[j] for heads g0..g0+GB-1, accumulators in registers; with
// `next_k`, each value also asks for the same key of the next task (keys 0..next_len-1), so that
// task's keys are on their way when it begins
template <int NC, int GB, typename T>
MINISERVE_TARGET void values_block(const float* p, const T* v, int64_t L, int g0, const float* inv_sum, T* out,
                                   const T* next_k, int64_t next_len) {
  __m512 acc[GB][NC];
  for (int i = 0; i < GB; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    if (j < next_len) {
      for (int64_t i = 0; i < int64_t(NC * 16 * sizeof(T)); i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next_k + j * NC * 16) + i, _MM_HINT_T0);
    }
    __m512 vj[NC];
    for (int c = 0; c < NC; ++c) vj[c] = load16(v + j * NC * 16 + c * 16);
    for (int i = 0; i < GB; ++i) {
      const __m512 pj = _mm512_set1_ps(p[(g0 + i) * L + j]);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_fmadd_ps(pj, vj[c], acc[i][c]);
    }
  }
  for (int i = 0; i < GB; ++i) {
    const __m512 w = _mm512_set1_ps(inv_sum[g0 + i]);
    for (int c = 0; c < NC; ++c) store16(out + (g0 + i) * NC * 16 + c * 16, _mm512_mul_ps(acc[i][c], w));
  }
}

template <int NC, int GB, typename T>
MINISERVE_TARGET void values_of(const float* p, const T* v, int64_t L, int G, const float* inv_sum, T* out,
                                const T* next_k, int64_t next_len) {
  int g = 0;
  for (; g + GB <= G; g += GB, next_len = 0) values_block<NC, GB>(p, v, L, g, inv_sum, out, next_k, next_len);
  if constexpr (GB > 1) {  // the group's last heads: one narrower block
    if (g < G) {
      switch (G - g) {
        case 1: values_block<NC, 1>(p, v, L, g, inv_sum, out, next_k, next_len); break;
        case 2: if constexpr (GB > 2) values_block<NC, 2>(p, v, L, g, inv_sum, out, next_k, next_len); break;
        case 3: if constexpr (GB > 3) values_block<NC, 3>(p, v, L, g, inv_sum, out, next_k, next_len); break;
        case 4: if constexpr (GB > 4) values_block<NC, 4>(p, v, L, g, inv_sum, out, next_k, next_len); break;
        case 5: if constexpr (GB > 5) values_block<NC, 5>(p, v, L, g, inv_sum, out, next_k, next_len); break;
        case 6: if constexpr (GB > 6) values_block<NC, 6>(p, v, L, g, inv_sum, out, next_k, next_len); break;
        default: if constexpr (GB > 7) values_block<NC, 7>(p, v, L, g, inv_sum, out, next_k, next_len); break;
      }
    }
  }
}

// The value pass for bf16 on CPUs with AVX512-BF16: the probabilities rounded to bf16, as SDPA's
// CPU flash kernel rounds them before its value product, then bf16 dot products over pairs of keys
// (each product exact in fp32, summed in fp32): one instruction per 16 outputs takes two keys,
// where the widened FMAs took one, and the values are not widened. pb holds each head's rounded
// probabilities, Lp (L rounded up to even) apart, a 0 after an odd L's last key, which is paired
// with zeros rather than the store's next key. Keys j and j + 1 interleaved 16 bits at a time put
// dimensions 8l..8l+3 of each 128-bit lane l in one vector and 8l+4..8l+7 in another, so each
// head's NC accumulators hold its outputs in that order until they are put back at the end.
template <int NC, int GB>
MINISERVE_TARGET_BF16 void values_block_dp(const uint16_t* pb, int64_t Lp, const uint16_t* v, int64_t L, int g0,
                                           const float* inv_sum, uint16_t* out, const uint16_t* next_k,
                                           int64_t next_len) {
  constexpr int64_t D = NC * 16;
  __m512 acc[GB][NC];
  for (int i = 0; i < GB; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; j += 2) {
    for (int64_t jj = j; jj < std::min(j + 2, next_len); ++jj) {
      for (int64_t i = 0; i < D * 2; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next_k + jj * D) + i, _MM_HINT_T0);
    }
    const bool two = j + 1 < L;
    __m512i vp[NC];
    for (int c = 0; c < NC / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(v + j * D + 32 * c);
      const __m512i b = two ? _mm512_loadu_si512(v + (j + 1) * D + 32 * c) : _mm512_setzero_si512();
      vp[2 * c] = _mm512_unpacklo_epi16(a, b);
      vp[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int i = 0; i < GB; ++i) {
      int32_t pair;
      std::memcpy(&pair, pb + (g0 + i) * Lp + j, 4);
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)vp[c], pp);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < GB; ++i) {
    const __m512 w = _mm512_set1_ps(inv_sum[g0 + i]);
    uint16_t* o = out + (g0 + i) * D;
    for (int c = 0; c < NC / 2; ++c) {
      store16(o + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(acc[i][2 * c], first, acc[i][2 * c + 1]), w));
      store16(o + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(acc[i][2 * c], second, acc[i][2 * c + 1]), w));
    }
  }
}

// values_of for the dot products: the scores (e^(s - max) after softmax_rows) rounded into pb first
template <int NC, int GB>
MINISERVE_TARGET_BF16 void values_of_dp(const float* p, const uint16_t* v, int64_t L, int G, const float* inv_sum,
                                        uint16_t* out, const uint16_t* next_k, int64_t next_len,
                                        std::vector<uint16_t>& pb) {
  const int64_t Lp = (L + 1) & ~int64_t(1);
  pb.resize(G * Lp);
  for (int g = 0; g < G; ++g) {
    for (int64_t j = 0; j < L; j += 16) store16(pb.data() + g * Lp + j, load16(p + g * L + j, lanes(L - j)), lanes(L - j));
    if (Lp > L) pb[g * Lp + L] = 0;
  }
  int g = 0;
  for (; g + GB <= G; g += GB, next_len = 0) values_block_dp<NC, GB>(pb.data(), Lp, v, L, g, inv_sum, out, next_k, next_len);
  switch (G - g) {  // the group's last heads: one narrower block
    case 0: break;
    case 1: values_block_dp<NC, 1>(pb.data(), Lp, v, L, g, inv_sum, out, next_k, next_len); break;
    case 2: if constexpr (GB > 2) values_block_dp<NC, 2>(pb.data(), Lp, v, L, g, inv_sum, out, next_k, next_len); break;
    case 3: if constexpr (GB > 3) values_block_dp<NC, 3>(pb.data(), Lp, v, L, g, inv_sum, out, next_k, next_len); break;
    case 4: if constexpr (GB > 4) values_block_dp<NC, 4>(pb.data(), Lp, v, L, g, inv_sum, out, next_k, next_len); break;
    case 5: if constexpr (GB > 5) values_block_dp<NC, 5>(pb.data(), Lp, v, L, g, inv_sum, out, next_k, next_len); break;
    case 6: if constexpr (GB > 6) values_block_dp<NC, 6>(pb.data(), Lp, v, L, g, inv_sum, out, next_k, next_len); break;
    default: if constexpr (GB > 7) values_block_dp<NC, 7>(pb.data(), Lp, v, L, g, inv_sum, out, next_k, next_len); break;
  }
}

// one (row, KV head) task: its G query heads against its L keys and values; `fresh`: its values are
// not in cache from the row before (not a prefill chunk's row), so they are asked for early
template <int NC, int GB, typename T>
MINISERVE_TARGET void attend_task(const T* qg, const T* k, const T* v, int64_t L, int G, float scale, T* out,
                                  bool fresh, const T* next_k, int64_t next_len, bool dp, std::vector<float>& qf,
                                  std::vector<float>& scores, std::vector<float>& inv_sum, std::vector<uint16_t>& pb) {
  scores.resize(G * L);
  if constexpr (std::is_same_v<T, uint16_t> && NC % 2 == 0) {
    if (dp) {
      scores_of_dp<NC>(qg, scale, k, fresh ? v : nullptr, L, G, scores.data());
      softmax_rows(scores.data(), L, G, inv_sum.data());
      values_of_dp<NC, GB>(scores.data(), v, L, G, inv_sum.data(), out, next_k, next_len, pb);
      return;
    }
  }
  for (int64_t i = 0; i < G * NC * 16; i += 16) store16(qf.data() + i, _mm512_mul_ps(load16(qg + i), _mm512_set1_ps(scale)));
  scores_of<NC>(qf.data(), k, fresh ? v : nullptr, L, G, scores.data());
  softmax_rows(scores.data(), L, G, inv_sum.data());
  values_of<NC, GB>(scores.data(), v, L, G, inv_sum.data(), out, next_k, next_len);
}


// ---- the fp32 task in AVX2 (CPUs without AVX-512): the same three passes in 8-lane vectors ----

MINISERVE_TARGET_AVX2 inline float reduce_max8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// r[i] = Σ lanes of a[i], for 4 vectors (two levels of pairwise horizontal sums, then the halves)
MINISERVE_TARGET_AVX2 inline __m128 sum4(const __m256* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// scores of GH heads (g0..) against 4 keys (kb: the first's NV vectors): each head's chunk c of q
// in a register, each key's chunk c loaded once for all GH heads (12 FMAs per 7 loads at GH = 3;
// one head at a time took a load per FMA, the bound of Zen 1's two 128-bit load ports)
template <int NV, int GH>
MINISERVE_TARGET_AVX2 inline void scores_block_avx2(const float* q, const float* kb, int64_t L, int g0, int64_t j0,
                                                    float* scores) {
  __m256 acc[GH][4];
#pragma GCC unroll 3
  for (int g = 0; g < GH; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int c = 0; c < NV; ++c) {
    __m256 qc[GH];
#pragma GCC unroll 3
    for (int g = 0; g < GH; ++g) qc[g] = _mm256_loadu_ps(q + (g0 + g) * NV * 8 + c * 8);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 kj = _mm256_loadu_ps(kb + j * NV * 8 + c * 8);
#pragma GCC unroll 3
      for (int g = 0; g < GH; ++g) acc[g][j] = _mm256_fmadd_ps(qc[g], kj, acc[g][j]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < GH; ++g) _mm_storeu_ps(scores + (g0 + g) * L + j0, sum4(acc[g]));
}

// scores_of in 8 lanes (NV vectors of 8 per key; q already scaled): keys in blocks of 4 (1 KB at
// D = 64, in L1 across the group's heads), heads three at a time; each score one FMA chain per
// lane in dimension order, then one transposing sum, as before the blocking. With `v`, each
// block's values are asked for (to L2) while its keys are dotted, as scores_of does.
template <int NV>
MINISERVE_TARGET_AVX2 void scores_of_avx2(const float* q, const float* k, const float* v, int64_t L, int G,
                                          float* scores) {
  int64_t j0 = 0;
  for (; j0 + 4 <= L; j0 += 4) {
    const float* kb = k + j0 * NV * 8;
    if (v) values_to_l2(v + j0 * NV * 8, 4 * NV * 8 * 4);
    int g = 0;
    for (; g + 3 <= G; g += 3) scores_block_avx2<NV, 3>(q, kb, L, g, j0, scores);
    if (G - g == 2) scores_block_avx2<NV, 2>(q, kb, L, g, j0, scores);
    if (G - g == 1) scores_block_avx2<NV, 1>(q, kb, L, g, j0, scores);
  }
  for (int64_t j = j0; j < L; ++j) {  // the last L % 4 keys, one at a time
    for (int g = 0; g < G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int c = 0; c < NV; ++c)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * NV * 8 + c * 8), _mm256_loadu_ps(k + j * NV * 8 + c * 8), acc);
      scores[g * L + j] = reduce_add8(acc);
    }
  }
}

// softmax_rows in 8 lanes
MINISERVE_TARGET_AVX2 void softmax_rows_avx2(float* scores, int64_t L, int G, float* inv_sum) {
  const int64_t body = L / 8 * 8;
  const __m256i tail = lanes8(L - body);
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * L;
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < body; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    float top = reduce_max8(m);
    for (int64_t j = body; j < L; ++j) top = std::max(top, s[j]);
    const __m256 mx = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < body; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (body < L) {  // masked lanes load as 0: their e^(0 - max) is cleared before the sum
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(load8(s + body, L - body), mx)), _mm256_castsi256_ps(tail));
      store8(s + body, e, L - body);
      sum = _mm256_add_ps(sum, e);
    }
    inv_sum[g] = 1.0f / reduce_add8(sum);
  }
}

// cache lines [l0, l1) of keys 0..len-1 at `keys` (the next task's), asked for by a value pass
struct LinePrefetch {
  const float* keys = nullptr;
  int64_t len = 0;
  int l0 = 0, l1 = 0;
};

// values_block in 8 lanes: heads g0..g0+GB-1, output vectors c0..c0+CW-1 (GB × CW accumulators),
// keys [j0, j1): the running sums go through `out` between blocks of keys; each key j also asks
// for `pf`'s lines of key j
template <int NV, int CW, int GB>
MINISERVE_TARGET_AVX2 void values_block_avx2(const float* p, const float* v, int64_t L, int64_t j0, int64_t j1, int g0,
                                             int c0, float* out, LinePrefetch pf) {
  __m256 acc[GB][CW];
#pragma GCC unroll 6
  for (int i = 0; i < GB; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < CW; ++c)
      acc[i][c] = j0 ? _mm256_loadu_ps(out + (g0 + i) * NV * 8 + (c0 + c) * 8) : _mm256_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    if (j < pf.len) {
      for (int l = pf.l0; l < pf.l1; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(pf.keys + j * NV * 8 + l * 16), _MM_HINT_T0);
    }
    const float* vj = v + j * NV * 8 + c0 * 8;
#pragma GCC unroll 6
    for (int i = 0; i < GB; ++i) {
      const __m256 pj = _mm256_broadcast_ss(p + (g0 + i) * L + j);
#pragma GCC unroll 4
      for (int c = 0; c < CW; ++c) acc[i][c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + c * 8), acc[i][c]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < GB; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < CW; ++c) _mm256_storeu_ps(out + (g0 + i) * NV * 8 + (c0 + c) * 8, acc[i][c]);
}

// 12 accumulators a pass: up to 4 output vectors × 3 heads (2 × 6 at head dim 16), so a group of
// heads takes several passes over the values: they go in blocks of 16 KB of values (in L1 for
// every pass), each output's sum still in key order. With `next_k`, the next task's keys
// (0..next_len-1) are asked for meanwhile, each pass an equal share of every key's cache lines
// (none for some passes where they outnumber the lines): spread so, the requests keep pace with
// the arithmetic, where all of a key's lines in one pass stalled the loads on a Zen 1; and every
// line is asked for, which paid where the passes are fewer than the lines (docs/architecture.md).
template <int NV>
MINISERVE_TARGET_AVX2 void values_of_avx2(const float* p, const float* v, int64_t L, int G, const float* inv_sum,
                                          float* out, const float* next_k, int64_t next_len) {
  constexpr int CW = NV < 4 ? NV : 4, GB = 12 / CW;
  constexpr int64_t kBlock = (16 << 10) / (NV * 8 * 4);  // keys
  constexpr int kLines = NV * 8 * 4 / 64;                // cache lines of a key
  const int passes = NV / CW * ((G + GB - 1) / GB);      // passes over each block of values
  for (int64_t j0 = 0; j0 < L; j0 += kBlock) {
    const int64_t j1 = std::min(L, j0 + kBlock);
    int pass = 0;
    auto share = [&]() {  // this pass's share of the next task's key lines
      LinePrefetch pf;
      if (next_k) pf = {next_k, next_len, pass * kLines / passes, (pass + 1) * kLines / passes};
      ++pass;
      return pf;
    };
    for (int c0 = 0; c0 < NV; c0 += CW) {
      int g = 0;
      for (; g + GB <= G; g += GB) values_block_avx2<NV, CW, GB>(p, v, L, j0, j1, g, c0, out, share());
      switch (G - g) {
        case 0: break;
        case 1: values_block_avx2<NV, CW, 1>(p, v, L, j0, j1, g, c0, out, share()); break;
        case 2: values_block_avx2<NV, CW, 2>(p, v, L, j0, j1, g, c0, out, share()); break;
        case 3: if constexpr (GB > 3) values_block_avx2<NV, CW, 3>(p, v, L, j0, j1, g, c0, out, share()); break;
        case 4: if constexpr (GB > 4) values_block_avx2<NV, CW, 4>(p, v, L, j0, j1, g, c0, out, share()); break;
        default: if constexpr (GB > 5) values_block_avx2<NV, CW, 5>(p, v, L, j0, j1, g, c0, out, share()); break;
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 w = _mm256_set1_ps(inv_sum[g]);
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(out + g * NV * 8 + c * 8, _mm256_mul_ps(_mm256_loadu_ps(out + g * NV * 8 + c * 8), w));
  }
}

// attend_task for fp32 in AVX2, asking for the same streams ahead as attend_task
template <int NV>
MINISERVE_TARGET_AVX2 void attend_task_avx2(const float* qg, const float* k, const float* v, int64_t L, int G,
                                            float scale, float* out, bool fresh, const float* next_k,
                                            int64_t next_len, std::vector<float>& qf, std::vector<float>& scores,
                                            std::vector<float>& inv_sum) {
  scores.resize(G * L);
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < G * NV * 8; i += 8) _mm256_storeu_ps(qf.data() + i, _mm256_mul_ps(_mm256_loadu_ps(qg + i), sc));
  scores_of_avx2<NV>(qf.data(), k, fresh ? v : nullptr, L, G, scores.data());
  softmax_rows_avx2(scores.data(), L, G, inv_sum.data());
  values_of_avx2<NV>(scores.data(), v, L, G, inv_sum.data(), out, next_k, next_len);
}

template <int NC, typename T>
void attend(const T* q, const T* ks, const T* vs, const int64_t* slots, const int64_t* lens, T* out, int64_t rows,
            int64_t heads, int64_t kv_heads, int64_t max_len, float scale) {
  constexpr int64_t D = NC * 16;
  constexpr int GB = kAccRegisters / NC > 8 ? 8 : kAccRegisters / NC;
  const int G = static_cast<int>(heads / kv_heads);
  // bf16 scores by AVX512-BF16 dot products where the CPU has them (and the mask allows them)
  const bool dp = std::is_same_v<T, uint16_t> && NC % 2 == 0 && cpu_has_avx512_bf16();
  const bool avx2_only = !cpu_has_avx512();  // fp32 only (decode_attention_supported)
  // The tasks are taken one at a time off a shared counter: where the cores run at different speeds
  // (a VM's vCPU whose core a neighbour's thread shares, big and little cores) a fixed share each
  // makes every layer wait for the slowest thread (as gemv.cpp's panels), and a prefill chunk's
  // later rows, which see more keys, balance themselves. A thread claims its next task when it
  // starts one, while at least one unclaimed task is left for every other thread, so that task's
  // keys are asked for during this one's value pass by the thread that reads them. Contiguous runs
  // of tasks, each ending on a hint at the next unclaimed run (which the other thread often took,
  // its keys then on their way to the wrong core), attended 24 layers of 8 bf16 decodes at 257
  // keys in 1.06-1.11x the time of this, and 1.9x with a busy loop on one of the two vCPUs
  // (docs/architecture.md). Near the end, where a claim ahead could leave another thread idle (a
  // single decode's two tasks), the last tasks are claimed as they are reached and ask for the
  // next unclaimed task's keys, a hint.
  const int64_t tasks = rows * kv_heads, threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(G * D), scores, inv_sum(G);
    std::vector<uint16_t> pb;  // the bf16 probabilities of values_of_dp
    auto kv_of = [&](int64_t t) { return (slots[t / kv_heads] * kv_heads + t % kv_heads) * max_len * D; };
    auto chunk_row = [&](int64_t r) {  // a row of a prefill chunk: a neighbouring row shares its slot
      return (r > 0 && slots[r - 1] == slots[r]) || (r + 1 < rows && slots[r + 1] == slots[r]);
    };
    auto claim = [&]() { return next_task.fetch_add(1, std::memory_order_relaxed); };
    for (int64_t t = claim(); t < tasks;) {
      const bool ahead = tasks - next_task.load(std::memory_order_relaxed) >= threads;
      const int64_t tn = ahead ? claim() : next_task.load(std::memory_order_relaxed);
      const int64_t r = t / kv_heads, h = t % kv_heads;
      const int64_t kv = kv_of(t), qo = (r * heads + h * G) * D;
      // the next task's keys are asked for during this one's value pass, as far as this task has
      // keys; not within a prefill chunk, whose rows share their slot's keys (in cache already)
      const T* next_k = nullptr;
      int64_t next_len = 0;
      if (tn < tasks) {
        const int64_t rn = tn / kv_heads;
        if (slots[rn] != slots[r] || (rn == r && !chunk_row(r))) next_k = ks + kv_of(tn), next_len = lens[rn];
      }
      bool attended = false;
      if constexpr (std::is_same_v<T, float>) {
        if (avx2_only) {
          attend_task_avx2<2 * NC>(q + qo, ks + kv, vs + kv, lens[r], G, scale, out + qo, !chunk_row(r), next_k,
                                   next_len, qf, scores, inv_sum);
          attended = true;
        }
      }
      if (!attended) {
        attend_task<NC, GB>(q + qo, ks + kv, vs + kv, lens[r], G, scale, out + qo, !chunk_row(r), next_k, next_len,
                            dp, qf, scores, inv_sum, pb);
      }
      t = ahead ? tn : claim();
    }
  });
}

template <typename T>
void attend_any(const T* q, const T* ks, const T* vs, const int64_t* slots, const int64_t* lens, T* out,
                int64_t rows, int64_t heads, int64_t kv_heads, int64_t max_len, int64_t D, float scale) {
  switch (D / 16) {
    case 1: attend<1>(q, ks, vs, slots, lens, out, rows, heads, kv_heads, max_len, scale); break;
    case 2: attend<2>(q, ks, vs, slots, lens, out, rows, heads, kv_heads, max_len, scale); break;
    case 4: attend<4>(q, ks, vs, slots, lens, out, rows, heads, kv_heads, max_len, scale); break;
    case 8: attend<8>(q, ks, vs, slots, lens, out, rows, heads, kv_heads, max_len, scale); break;
    default: TORCH_CHECK(false, "miniserve::decode_attention: head dim ", D, " is not 16, 32, 64 or 128");
  }
}

#endif  // MINISERVE_X86

bool decode_attention_supported(at::ScalarType dtype, int64_t head_dim) {
#ifdef MINISERVE_X86
  const bool dim_ok = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
  return dim_ok && ((dtype == at::kFloat && (cpu_has_avx512() || cpu_has_avx2())) ||
                    (dtype == at::kBFloat16 && cpu_has_avx512()));
#endif
  return false;
}

}  // namespace

namespace miniserve_ops {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_store, const at::Tensor& v_store,
                            const at::Tensor& slots, const at::Tensor& lens, double scale) {
  const char* op = "miniserve::decode_attention: ";
  TORCH_CHECK(q.dim() == 3 && k_store.dim() == 4 && v_store.dim() == 4, op,
              "q must be (rows, heads, D) and the stores (slots, kv_heads, max_len, D)");
  const int64_t rows = q.size(0), heads = q.size(1), D = q.size(2);
  const int64_t num_slots = k_store.size(0), kv_heads = k_store.size(1), max_len = k_store.size(2);
  TORCH_CHECK(decode_attention_supported(q.scalar_type(), D), op, "no kernel for ", q.scalar_type(),
              " and head dim ", D, " on this CPU");
  TORCH_CHECK(k_store.sizes() == v_store.sizes() && k_store.size(3) == D, op, "keys ", k_store.sizes(), ", values ",
              v_store.sizes(), " and queries of head dim ", D, " do not match");
  TORCH_CHECK(k_store.scalar_type() == q.scalar_type() && v_store.scalar_type() == q.scalar_type(), op,
              "q, keys and values must share one dtype");
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, op, heads, " query heads cannot share ", kv_heads,
              " KV heads");
  TORCH_CHECK(q.is_contiguous() && k_store.is_contiguous() && v_store.is_contiguous(), op,
              "q and the stores must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && slots.dim() == 1 &&
                  lens.dim() == 1 && slots.size(0) == rows && lens.size(0) == rows && slots.is_contiguous() &&
                  lens.is_contiguous(),
              op, "slots and lens must be contiguous int64 (rows,) tensors");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, op, "row ", r, " reads slot ", sp[r], " of ", num_slots);
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= max_len, op, "row ", r, " sees ", lp[r], " keys; a slot holds 1 to ",
                max_len);
  }
  at::Tensor out = at::empty({rows, heads, D}, q.options());
#ifdef MINISERVE_X86
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    attend_any(q.data_ptr<float>(), k_store.data_ptr<float>(), v_store.data_ptr<float>(), sp, lp,
               out.data_ptr<float>(), rows, heads, kv_heads, max_len, D, s);
  } else {
    attend_any<uint16_t>(ptr<uint16_t>(q), ptr<uint16_t>(k_store), ptr<uint16_t>(v_store), sp, lp, ptr<uint16_t>(out),
                         rows, heads, kv_heads, max_len, D, s);
  }
#endif
  return out;
}

}  // namespace miniserve_ops

TORCH_LIBRARY_FRAGMENT(miniserve, m) {
  m.def("decode_attention(Tensor q, Tensor k_store, Tensor v_store, Tensor slots, Tensor lens, float scale) -> Tensor");
  m.def("decode_attention_supported(ScalarType dtype, int head_dim) -> bool", &decode_attention_supported);
}

TORCH_LIBRARY_IMPL(miniserve, CPU, m) { m.impl("decode_attention", &miniserve_ops::decode_attention); }
