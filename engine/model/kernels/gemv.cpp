// miniserve::gemv — y (M, N) = x (M, K) · wᵀ + bias with w pre-arranged in panels. Made for
// decode-sized M (a decode step, a short chunk, a prefill's sampled rows); any M runs, row_block
// rows per pass over the weights (engine/model/kernels/dispatch.py sizes it from the CPU's cache
// and measures the kernel against oneDNN and F.linear at each row count before the engine uses it).
//
// Why: a decode step reads every weight once and does little arithmetic with it, so at a few rows
// its time is how fast the weights stream from memory, and oneDNN's linear reads them below what a
// plain sweep of the same bytes reaches (docs/architecture.md has the figures). Here each weight
// byte is loaded once, in address order, and used for every row while it is in a register (up to
// stream_rows rows, 8-16, measured per machine; AVX2 3-6): w is
// stored as panels of 32 output columns (engine/kernels/__init__.py pack_panels), so one k step of
// a panel is two vectors holding 32 outputs' weights; each row's x[k] is broadcast and multiplied
// in (fp32 FMA; bf16 AVX512-BF16 dot products over k pairs, summed in fp32 as oneDNN's bf16 matmul
// does, except that these instructions flush bf16 denormals to zero). Past stream_rows a panel's k
// block is multiplied into the rows 8 at a time while it sits in L1, so the weights still come from
// memory once and the work becomes FMA-bound. Each output keeps one running sum in k order (in
// registers over a k block, in L1 between blocks), so there are no reductions across lanes and the
// blocking changes no rounding; the fp32 error grows with K a little faster than oneDNN's blocked
// sums (~1e-5 on the 0.5B model's logits). The bias is added in fp32 and the result rounded once to
// the input dtype. benchmarks/gemv_kernel.py measures it against oneDNN.
//
// On a CPU with AVX2 but no AVX-512 the fp32 product runs the same scheme in 256-bit vectors
// (panel_f32_avx2): same panels, same FMA chain per output in k order, so the same values.
//
// On a CPU with AMX (bf16 tiles) the bf16 product can run on the tiles instead (run_panels_amx),
// from `amx_rows` rows on: the bf16 panels are AMX's weight layout as they are, so nothing is
// packed again. Where that pays, and how far ahead of the arithmetic the weight stream is asked
// for (`prefetch_one` at one row, `prefetch` at more, each into L1 or L2: `prefetch_one_l2`,
// `prefetch_l2`), is measured per machine (engine/model/kernels/dispatch.py).
//
// Built at first use by engine/kernels/__init__.py (torch.utils.cpp_extension). The kernels are
// compiled with target attributes and only run where the CPU has what they need
// (miniserve::gemv_supported: AVX-512 for both dtypes, or AVX2 for fp32); elsewhere the engine
// keeps oneDNN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "ops.h"
#include "simd.h"

// The AMX intrinsics and target names need GCC 11 or clang 12; an older compiler builds the rest
#if defined(MINISERVE_X86) && ((defined(__clang__) && __clang_major__ >= 12) || \
                               (!defined(__clang__) && __GNUC__ >= 11))
#define MINISERVE_AMX 1
#include <cpuid.h>
#endif

namespace {

using miniserve_ops::ptr;

constexpr int64_t kPanel = 32;     // output columns per panel (engine/kernels/__init__.py PANEL)
constexpr int64_t kBlockRows = 8;  // rows per register block: 2 accumulators per row, 16 of 32 registers
constexpr int64_t kStreamRowsMax = 16;  // the most rows one sweep of the weights takes (GemvTuning.stream_rows)
constexpr int64_t kSweepRowsAvx2 = 6;  // AVX2's longest sweep: two passes of 3 rows × a whole panel per sub-block
constexpr int64_t kPassRowsAvx2 = 3;   // AVX2's pass: 3 rows × a whole panel (12 accumulators); its shortest sweep
constexpr int64_t kStepBytes = 128;    // one k step of a fp32 panel, one k pair of a bf16 one

// The shape pack_panels gives a weight of N outputs × K inputs (engine.kernels.panel_shape)
std::vector<int64_t> panel_shape(bool bf16, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  return bf16 ? std::vector<int64_t>{panels, (K + 1) / 2, kPanel, 2} : std::vector<int64_t>{panels, K, kPanel};
}

#ifdef MINISERVE_X86

using namespace miniserve_simd;

bool cpu_has(bool bf16) {  // bf16 also needs AVX512-BF16's dot products; fp32 runs on AVX2 too
  return bf16 ? cpu_has_avx512_bf16() : cpu_has_avx512() || cpu_has_avx2();
}

// What a kernel call asks the memory for while it multiplies (both kinds of step are 128 bytes: one
// k step of a fp32 panel, one k pair of a bf16 one). `ahead` > 0: each k step asks for the weights
// `ahead` steps on (a stream: past this panel's end that is the next panel's start, panels are
// contiguous). Otherwise, the steps [next, end) (bytes), one every `every` k steps: a share of the
// next k block, spread over the call so that memory works while the arithmetic runs.
struct Prefetch {
  int64_t ahead = 0;
  bool to_l2 = false;  // `ahead`'s requests fill L2 (T1) rather than L1 (T0)
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t every = 1;
};

// SSE's prefetch: every x86-64 CPU has it, so both the AVX-512 and the AVX2 loops inline it. The
// L2 form is written as the instruction itself: GCC 12 compiled _mm_prefetch(p, _MM_HINT_T1) in this
// branch to nothing once inlined into the kernels (a bare `if (to_l2) skip`; called straight, as the
// attention kernel and the tiles' next-panel requests do, it compiles), so every "into L2" tuning
// ran without software prefetch at all. The address goes in a register, not as a memory operand:
// that one made GCC keep the kernels' accumulators in memory around it.
inline void prefetch_step(const char* p, bool to_l2 = false) {
  if (to_l2) {
    asm volatile("prefetcht1 (%0)\n\tprefetcht1 64(%0)" ::"r"(p));
  } else {
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
  }
}

// One block of M rows times one panel over the weights' k range [k0, k1): the running sums come
// from `part` (M × 32 fp32; zero when k0 == 0) and go back to it, so splitting K changes no
// rounding. `pf` says what to prefetch meanwhile: with Spread its [next, end), else `ahead`.
// wp: (panels, K, 32) fp32
template <int M, bool Spread>
MINISERVE_TARGET void panel_f32(const float* x, int64_t K, const float* w, int64_t k0, int64_t k1, float* part,
                                Prefetch pf) {
  __m512 a0[M], a1[M];
  for (int m = 0; m < M; ++m) {
    a0[m] = k0 ? _mm512_loadu_ps(part + m * kPanel) : _mm512_setzero_ps();
    a1[m] = k0 ? _mm512_loadu_ps(part + m * kPanel + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = k0; k < k1;) {  // Spread: runs of `every` k steps, each after one step's prefetch
    int64_t run_end = k1;
    if (Spread && pf.next < pf.end) {
      run_end = std::min(k1, k + pf.every);
      prefetch_step(pf.next);
      pf.next += kStepBytes;
    }
    for (; k < run_end; ++k) {
      if (!Spread && pf.ahead) prefetch_step(reinterpret_cast<const char*>(w + (k + pf.ahead) * kPanel), pf.to_l2);
      const __m512 w0 = _mm512_loadu_ps(w + k * kPanel), w1 = _mm512_loadu_ps(w + k * kPanel + 16);
      for (int m = 0; m < M; ++m) {
        const __m512 xb = _mm512_set1_ps(x[m * K + k]);
        a0[m] = _mm512_fmadd_ps(w0, xb, a0[m]);
        a1[m] = _mm512_fmadd_ps(w1, xb, a1[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm512_storeu_ps(part + m * kPanel, a0[m]);
    _mm512_storeu_ps(part + m * kPanel + 16, a1[m]);
  }
}

// panel_f32 in AVX2's 16 256-bit registers. A k step of a panel is four vectors, and rows take the
// whole panel, three per pass (12 accumulators; of the 4 weight vectors the compiler keeps 3 in
// registers and reads the 4th with each row's FMA: 12 FMAs per 3 broadcasts and 6 loads):
// measured faster at every row count from 3 than six rows × half a panel (12 FMAs per 6
// broadcasts and 2 loads), and four rows faster as 3 + 1 than as 2 + 2
// (figures in docs/architecture.md). M rows are taken over sub-blocks
// of kSubSteps k steps (16 KB of weights, held in L1 while every pass multiplies them), the
// running sums going through `part` between sub-blocks as between k blocks: each output's sum
// stays one FMA chain in k order, as in panel_f32. The first pass of each sub-block asks for what
// `pf` says.
constexpr int64_t kSubSteps = 128;

// R rows × H vectors of 8 outputs (columns [col, col + 8H) of the panel) over k steps [k0, k1)
template <int R, int H, bool Spread>
MINISERVE_TARGET_AVX2 inline void rows_f32_avx2(const float* x, int64_t K, const float* w, int64_t col, int64_t k0,
                                                int64_t k1, bool fresh, float* part, Prefetch* pf) {
  __m256 a[R][H];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < H; ++j)
      a[r][j] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(part + r * kPanel + col + 8 * j);
  for (int64_t k = k0; k < k1;) {
    int64_t run_end = k1;
    if (Spread && pf && pf->next < pf->end) {
      run_end = std::min(k1, k + pf->every);
      prefetch_step(pf->next);
      pf->next += kStepBytes;
    }
    for (; k < run_end; ++k) {
      if (!Spread && pf && pf->ahead) {
        prefetch_step(reinterpret_cast<const char*>(w + (k + pf->ahead) * kPanel), pf->to_l2);
      }
      __m256 wv[H];
#pragma GCC unroll 4
      for (int j = 0; j < H; ++j) wv[j] = _mm256_loadu_ps(w + k * kPanel + col + 8 * j);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 4
        for (int j = 0; j < H; ++j) a[r][j] = _mm256_fmadd_ps(wv[j], xb, a[r][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < H; ++j) _mm256_storeu_ps(part + r * kPanel + col + 8 * j, a[r][j]);
}

// M rows in passes of up to three, each the whole panel, over k steps [k0, k1)
template <int M, bool Spread>
MINISERVE_TARGET_AVX2 inline void passes_f32_avx2(const float* x, int64_t K, const float* w, int64_t k0, int64_t k1,
                                                  bool fresh, float* part, Prefetch* pf) {
  constexpr int R = M > 3 ? 3 : M;
  rows_f32_avx2<R, 4, Spread>(x, K, w, 0, k0, k1, fresh, part, pf);
  if constexpr (M > R) passes_f32_avx2<M - R, Spread>(x + R * K, K, w, k0, k1, fresh, part + R * kPanel, nullptr);
}

template <int M, bool Spread>
MINISERVE_TARGET_AVX2 void panel_f32_avx2(const float* x, int64_t K, const float* w, int64_t k0, int64_t k1,
                                          float* part, Prefetch pf) {
  for (int64_t s0 = k0; s0 < k1; s0 += kSubSteps) {
    const int64_t s1 = std::min(k1, s0 + kSubSteps);
    passes_f32_avx2<M, Spread>(x, K, w, s0, s1, s0 == 0, part, &pf);
  }
}

// The same over k pairs [kk0, kk1). wp: (panels, ceil(K / 2), 32, 2) bf16: lane j of a vector
// holds output j's weights for k pair kk.
template <int M, bool Spread>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16"))) void panel_bf16(
    const uint16_t* x, int64_t K, const uint16_t* w, int64_t kk0, int64_t kk1, float* part, Prefetch pf) {
  const int64_t full = K / 2;
  __m512 a0[M], a1[M];
  for (int m = 0; m < M; ++m) {
    a0[m] = kk0 ? _mm512_loadu_ps(part + m * kPanel) : _mm512_setzero_ps();
    a1[m] = kk0 ? _mm512_loadu_ps(part + m * kPanel + 16) : _mm512_setzero_ps();
  }
  // x[2kk] in the low half of each 32-bit lane, x[2kk + 1] in the high: broadcast, one dot
  // product. The last pair of an odd K has no x[2kk + 1] (its weights there are 0): it is done
  // apart, so the main loop has no branch and its sums stay in registers.
  const int64_t paired_end = std::min(kk1, full);
  for (int64_t kk = kk0; kk < paired_end;) {  // as panel_f32's
    int64_t run_end = paired_end;
    if (Spread && pf.next < pf.end) {
      run_end = std::min(paired_end, kk + pf.every);
      prefetch_step(pf.next);
      pf.next += kStepBytes;
    }
    for (; kk < run_end; ++kk) {
      if (!Spread && pf.ahead) {
        prefetch_step(reinterpret_cast<const char*>(w + (kk + pf.ahead) * kPanel * 2), pf.to_l2);
      }
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kk * kPanel * 2);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kk * kPanel * 2 + 32);
      for (int m = 0; m < M; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * K + 2 * kk, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        a0[m] = _mm512_dpbf16_ps(a0[m], w0, xb);
        a1[m] = _mm512_dpbf16_ps(a1[m], w1, xb);
      }
    }
  }
  if (kk1 > full) {  // kk == full: K is odd
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + full * kPanel * 2);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + full * kPanel * 2 + 32);
    for (int m = 0; m < M; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * K + K - 1]));
      a0[m] = _mm512_dpbf16_ps(a0[m], w0, xb);
      a1[m] = _mm512_dpbf16_ps(a1[m], w1, xb);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm512_storeu_ps(part + m * kPanel, a0[m]);
    _mm512_storeu_ps(part + m * kPanel + 16, a1[m]);
  }
}

// y[rows, panel p's 32 outputs] = the finished sums + bias, rounded once to y's dtype
template <typename T>
MINISERVE_TARGET void finish_panel(const float* part, int64_t rows, const T* bias, T* y, int64_t p, int64_t N) {
  const int64_t n0 = p * kPanel;
  const __mmask16 k0 = lanes(N - n0), k1 = lanes(N - n0 - 16);
  const __m512 b0 = bias ? load16(bias + n0, k0) : _mm512_setzero_ps();
  const __m512 b1 = bias && k1 ? load16(bias + n0 + 16, k1) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    store16(y + m * N + n0, _mm512_add_ps(_mm512_loadu_ps(part + m * kPanel), b0), k0);
    if (k1) store16(y + m * N + n0 + 16, _mm512_add_ps(_mm512_loadu_ps(part + m * kPanel + 16), b1), k1);
  }
}

// finish_panel in AVX2 (fp32): 8 outputs at a time, a ragged last panel's tail one by one
MINISERVE_TARGET_AVX2 void finish_panel_avx2(const float* part, int64_t rows, const float* bias, float* y, int64_t p,
                                             int64_t N) {
  const int64_t n0 = p * kPanel, n = std::min<int64_t>(kPanel, N - n0);
  for (int64_t m = 0; m < rows; ++m) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 b = bias ? _mm256_loadu_ps(bias + n0 + j) : _mm256_setzero_ps();
      _mm256_storeu_ps(y + m * N + n0 + j, _mm256_add_ps(_mm256_loadu_ps(part + m * kPanel + j), b));
    }
    for (; j < n; ++j) y[m * N + n0 + j] = part[m * kPanel + j] + (bias ? bias[n0 + j] : 0.0f);
  }
}

// gate_up_silu's finish: panel p of interleaved gate/up weights holds gate outputs 16p..16p+15 in
// its first 16 columns and the same up outputs in its last 16 (engine.kernels.interleave_gate_up),
// so y[rows, 16p..16p+15] = silu(gate) · up from the panel's own sums, each rounded to T first as
// the gemv's outputs would be before layer_ops' silu_mul read them: the same bits as the two ops
template <typename T>
MINISERVE_TARGET void finish_silu(const float* part, int64_t rows, T* y, int64_t p, int64_t inter) {
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 gate = round_to(y, _mm512_loadu_ps(part + m * kPanel));
    const __m512 up = round_to(y, _mm512_loadu_ps(part + m * kPanel + 16));
    store16(y + m * inter + p * 16, silu_times(y, gate, up));
  }
}

// finish_silu in AVX2 (fp32)
MINISERVE_TARGET_AVX2 void finish_silu_avx2(const float* part, int64_t rows, float* y, int64_t p, int64_t inter) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t j = 0; j < 16; j += 8) {
      const __m256 gate = _mm256_loadu_ps(part + m * kPanel + j), up = _mm256_loadu_ps(part + m * kPanel + 16 + j);
      _mm256_storeu_ps(y + m * inter + p * 16 + j, silu_times8(gate, up));
    }
  }
}

// fn(integral_constant<M>) for M = rows in [1, Max) and Max past that
template <int Max, int M = 1, typename Fn>
void for_rows(int64_t rows, Fn&& fn) {
  if constexpr (M < Max) {
    if (rows == M) return fn(std::integral_constant<int, M>{});
    for_rows<Max, M + 1>(rows, fn);
  } else {
    fn(std::integral_constant<int, Max>{});
  }
}

// fn(r0, r1, rows in the last register block) for each run of row_block rows
template <int64_t BlockRows, typename Fn>
void for_chunks(int64_t M, int64_t row_block, Fn&& fn) {
  for (int64_t r0 = 0; r0 < M; r0 += row_block) {
    const int64_t r1 = std::min(M, r0 + row_block), n = r1 - r0;
    fn(r0, r1, n - (n - 1) / BlockRows * BlockRows);
  }
}

// The panels go out to torch's threads in runs taken off a shared counter rather than one fixed
// share each: where the cores run at different speeds (a VM's vCPU whose core a neighbour's thread
// shares, big and little cores) a fixed share makes every product wait for its slowest thread, and
// a run is still a forward stream of whole panels. Each run is the panels left over twice the
// threads (at least one), as OpenMP's guided schedule: long runs first, single panels at the end,
// so the threads finish within a panel of each other. Runs of a fixed size (panels / (threads ×
// 8)) left a thread idle for up to a run at the end of every product: 3-5% of a two-thread decode's
// products on the Zen 4 (docs/architecture.md has the figures). fn(p0, p1) may run several times
// on one thread.
template <typename Fn>
void parallel_panels(int64_t panels, Fn&& fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t p0 = next.load(std::memory_order_relaxed); p0 < panels;) {
      const int64_t run = std::max<int64_t>(1, (panels - p0) / (2 * threads));
      if (next.compare_exchange_weak(p0, p0 + run, std::memory_order_relaxed)) {  // else p0 is the counter now
        fn(p0, p0 + run);
        p0 = next.load(std::memory_order_relaxed);
      }
    }
  });
}

// A thread's run of panels is one forward stream of weights (parallel_panels). Up to `stream_rows`
// rows (GemvTuning.stream_rows, clamped to [BlockRows, StreamRows]: 8-16 with AVX-512, 3-6 with AVX2) a
// panel is multiplied in one sweep of K while its weights stream from memory, each k step asking
// for the weights `stream.ahead` steps on, into L1 or L2 (`stream.to_l2`; 0 leaves it to the
// hardware prefetcher): how far and where differs between CPUs, so dispatch.py measures it
// (docs/architecture.md). Every row takes its FMAs while the weight is in a register and the sweep
// asks memory for weights all the time; 16 rows' sums are all 32 AVX-512 registers, and what the
// compiler then spills cost less than blocking did on one CPU (dispatch.py measures that too). Past
// stream_rows, K is cut into
// blocks of `block_steps` k steps (k pairs in bf16; dispatch.k_block sizes them to two thirds of
// the L1 cache, AVX2's fp32 rounds that down to whole sub-blocks): every BlockRows-row block of
// the row_block rows (AVX2: each 3-row pass) multiplies a k block in turn while it sits in cache,
// so the weights come from memory once per row_block rows. Meanwhile the next k block is
// asked for, each pass a 1/passes share of it, one k step every few of its own: the requests go
// out at the pace the arithmetic consumes the weights, so memory works all through the block
// (without that, memory and arithmetic took turns: at 32 rows the product cost the weight stream
// plus three quarters of the FLOPs; asking for the whole next block in each pass, or in the first
// one, sent the requests out in bursts and pushed this block out of the L1 before its later
// passes: 0.93x (fp32) and 0.94x (bf16) the time of that at 32 rows, docs/architecture.md; AVX2's
// blocks of two 3-row passes, the second asking for nothing, took 1.03x the time of a share per
// pass at 8 rows). Even so the passes over a block overlap memory less than one sweep does, hence
// stream_rows.
template <int64_t BlockRows, int64_t StreamRows, typename T, typename Kernel, typename Finish>
void run_panels(const T* xp, const T* wpp, int64_t M, int64_t N, int64_t K, int64_t steps,
                int64_t block_steps, int64_t row_block, int64_t stream_rows, Prefetch stream, Kernel&& kernel,
                Finish&& finish) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t step_elems = kPanel * (sizeof(T) == 2 ? 2 : 1), panel_elems = steps * step_elems;
  static_assert(kPanel * 4 == kStepBytes, "a k step of a panel is 128 bytes in fp32 and in bf16");
  stream_rows = std::clamp<int64_t>(stream_rows, BlockRows, StreamRows);
  for_chunks<BlockRows>(M, row_block, [&](int64_t r0, int64_t r1, int64_t last) {
    const int64_t rows = r1 - r0;
    const bool blocked = rows > stream_rows;
    const int64_t block = std::max<int64_t>(1, block_steps);
    const int64_t passes = (rows + BlockRows - 1) / BlockRows;
    parallel_panels(panels, [&](int64_t p0, int64_t p1) {
      std::vector<float> part(rows * kPanel);  // the running sums of one panel's outputs
      for (int64_t p = p0; p < p1; ++p) {
        const T* w = wpp + p * panel_elems;
        if (!blocked) {  // one sweep of the whole K, every row at once
          for_rows<StreamRows>(rows, [&](auto m) {
            kernel(m, std::false_type{}, xp + r0 * K, K, w, 0, steps, part.data(), stream);
          });
        } else {  // blocks of K in cache, BlockRows rows a pass
          for (int64_t s0 = 0; s0 < steps; s0 += block) {
            const int64_t s1 = std::min(steps, s0 + block);
            // the next k block: this panel's, else the next panel's first (this run's panels only)
            const int64_t next = s1 < steps  ? std::min(steps, s1 + block) - s1
                                 : p + 1 < p1 ? std::min(steps, block)
                                              : 0;
            const char* start = reinterpret_cast<const char*>(w) + s1 * kStepBytes;
            int64_t r = r0, pass = 0;
            auto share = [&]() {  // pass `pass`'s share of the next block, spread over its s1 - s0 k steps
              Prefetch pf;
              const int64_t lo = pass * next / passes, hi = (pass + 1) * next / passes;
              pf.next = start + lo * kStepBytes;
              pf.end = start + hi * kStepBytes;
              pf.every = std::max<int64_t>(1, (s1 - s0) / std::max<int64_t>(1, hi - lo));
              ++pass;
              return pf;
            };
            for (; r + BlockRows < r1; r += BlockRows) {
              kernel(std::integral_constant<int, BlockRows>{}, std::true_type{}, xp + r * K, K, w, s0, s1,
                     part.data() + (r - r0) * kPanel, share());
            }
            const Prefetch pf = share();
            for_rows<BlockRows>(last, [&](auto m) {
              kernel(m, std::true_type{}, xp + r * K, K, w, s0, s1, part.data() + (r - r0) * kPanel, pf);
            });
          }
        }
        finish(part.data(), r0, rows, p);
      }
    });
  });
}

#ifdef MINISERVE_AMX
// ---- AMX: the bf16 product on tiles ----------------------------------------------------------
// The bf16 panels are AMX's weight (B) layout as they are: a k pair of a panel is 32 outputs × 2
// bf16 = 128 bytes, so 16 k pairs × 16 outputs is a B tile at a 128-byte stride, and the panel's
// other 16 outputs the same tile 64 bytes on. x's rows are the A tiles (16 rows × 16 k pairs at K's
// stride). Each output's sum is fp32 in k-pair order, as panel_bf16's (the two products of a pair
// may be added in the other order, so a value can differ from panel_bf16's in its last bit).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {  // Linux hands a process the tiles' state only on request
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

bool cpu_has_amx() {
  // CPUID 7.0 EDX: bit 22 AMX-BF16, bit 24 AMX-TILE (older compilers' cpu_supports lack them). Read
  // once: in a VM every CPUID traps to the hypervisor, and each gemv call with amx_rows checks this
  static const bool tiles = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
  }();
  return cpu_has_avx512_bf16() && allow_amx_bf16().load(std::memory_order_relaxed) && tiles && amx_permitted();
}

// Tiles 0-3 hold the sums (row block b, panel half h: tile 2b + h; 16 rows × 16 fp32), 4-5 x's
// rows (row block b: tile 4 + b), 6-7 the panel's halves. `rows` < 16 shapes row block 0's tiles
// for a last, short block of rows.
__attribute__((target("amx-tile"))) void amx_configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = (t == 0 || t == 1 || t == 4) ? rows : 16;
  }
  // not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes, and the stores of the rest
  // of the configuration were dropped (a #GP at ldtilecfg)
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

// RB row blocks × a panel's 32 outputs over k pairs [0, kk_end) (a multiple of 16): the sums go to
// `part` (rows × 32 fp32). `ahead`, when set, is asked for meanwhile, 2 KB (16 k pairs) per step,
// and `next.lines` cache lines of `next` per step into L2 (the next panel; `next` is advanced).
struct NextPanel {
  const char* at = nullptr;
  const char* end = nullptr;
  int64_t lines = 0;  // per 16-k-pair step
};

template <int RB>
__attribute__((target("amx-tile,amx-bf16"))) void panel_amx(const uint16_t* x, int64_t K, const uint16_t* w,
                                                           int64_t kk_end, float* part, const char* ahead,
                                                           bool to_l2, NextPanel& next) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RB == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t xstride = K * 2;
  for (int64_t kk = 0; kk < kk_end; kk += 16) {
    if (ahead) {
      for (int64_t b = 0; b < 16 * kStepBytes; b += kStepBytes) prefetch_step(ahead + kk * kStepBytes + b, to_l2);
    }
    for (int64_t l = 0; l < next.lines && next.at < next.end; ++l, next.at += 64) _mm_prefetch(next.at, _MM_HINT_T1);
    _tile_loadd(6, w + kk * kPanel * 2, kStepBytes);
    _tile_loadd(7, w + kk * kPanel * 2 + 32, kStepBytes);
    _tile_loadd(4, x + 2 * kk, xstride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RB == 2) {
      _tile_loadd(5, x + 16 * K + 2 * kk, xstride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, part, kStepBytes);
  _tile_stored(1, part + 16, kStepBytes);
  if constexpr (RB == 2) {
    _tile_stored(2, part + 16 * kPanel, kStepBytes);
    _tile_stored(3, part + 16 * kPanel + 16, kStepBytes);
  }
}

// Each run of panels (parallel_panels) goes row_block rows at a time (whole 32s); every row block
// sweeps a panel's whole K (blocks of K that stay in L1, as the vector loop takes them, were slower here:
// the sums' tiles then go to memory and back between blocks; docs/architecture.md): pairs of
// 16-row blocks (each weight tile used twice, each x tile twice), a last 16-row block, then the
// rows past the last 16 with their own tile shape; the first row block asks for the weights
// `stream.ahead` k pairs on, and all of them together ask for the run's next panel into L2, an
// even share per step over the panel's sweeps: the tiles' arithmetic then overlaps a whole panel's
// memory latency, which the short `ahead` alone did not (docs/architecture.md has the figures).
// What the tiles do not cover (an odd K's last pair, the k pairs past
// the last 16) panel_bf16 adds to the tiles' sums.
template <typename Finish>
void run_panels_amx(const uint16_t* xp, const uint16_t* wpp, int64_t M, int64_t N, int64_t K, int64_t row_block,
                    Prefetch stream, Finish&& finish) {
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2, kk_tiles = K / 2 / 16 * 16;
  const int64_t panel_elems = pairs * kPanel * 2, block = std::max<int64_t>(32, row_block / 32 * 32);
  for (int64_t r0 = 0; r0 < M; r0 += block) {
    const int64_t r1 = std::min(M, r0 + block), rows = r1 - r0, full = rows / 16 * 16, tail = rows - full;
    parallel_panels(panels, [&](int64_t p0, int64_t p1) {
      std::vector<float> part(rows * kPanel);
      int shape = 0;  // the rows the tiles are configured for (0: not yet)
      auto configure = [&](int r) {
        if (shape != r) amx_configure(r);
        shape = r;
      };
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* w = wpp + p * panel_elems;
        float* sums = part.data();
        if (kk_tiles) {
          const char* ahead = stream.ahead ? reinterpret_cast<const char*>(w) + stream.ahead * kStepBytes : nullptr;
          NextPanel next;
          if (p + 1 < p1) {
            const int64_t sweeps = full / 32 + full % 32 / 16 + (tail ? 1 : 0), bytes = panel_elems * 2;
            next.at = reinterpret_cast<const char*>(w + panel_elems);
            next.end = next.at + bytes;
            next.lines = (bytes / 64 + sweeps * (kk_tiles / 16) - 1) / (sweeps * (kk_tiles / 16));
          }
          if (full) configure(16);
          int64_t r = 0;
          for (; r + 32 <= full; r += 32, ahead = nullptr) {
            panel_amx<2>(xp + (r0 + r) * K, K, w, kk_tiles, sums + r * kPanel, ahead, stream.to_l2, next);
          }
          if (r < full) {
            panel_amx<1>(xp + (r0 + r) * K, K, w, kk_tiles, sums + r * kPanel, ahead, stream.to_l2, next);
            ahead = nullptr;
          }
          if (tail) {
            configure(static_cast<int>(tail));
            panel_amx<1>(xp + (r0 + full) * K, K, w, kk_tiles, sums + full * kPanel, ahead, stream.to_l2, next);
          }
        }
        for (int64_t r = 0; kk_tiles < pairs && r < rows; r += kBlockRows) {  // the k pairs the tiles left
          for_rows<kBlockRows>(std::min<int64_t>(kBlockRows, rows - r), [&](auto m) {
            panel_bf16<decltype(m)::value, false>(xp + (r0 + r) * K, K, w, kk_tiles, pairs, sums + r * kPanel,
                                                  Prefetch{});
          });
        }
        finish(sums, r0, rows, p);
      }
      if (shape) amx_release();
    });
  }
}
#endif  // MINISERVE_AMX

#endif  // MINISERVE_X86

bool gemv_supported(at::ScalarType dtype) {
#ifdef MINISERVE_X86
  if (dtype == at::kFloat) return cpu_has(false);
  if (dtype == at::kBFloat16) return cpu_has(true);
#endif
  return false;
}

bool gemv_amx_supported() {
#ifdef MINISERVE_AMX
  return cpu_has_amx();
#endif
  return false;
}

// The vector loop (or tiles) each kind of product runs on, as a tag its finish is told
struct Avx512 {};
struct Avx2 {};

// The checks every product on panels makes (`op` names it in the errors): x (rows, K) against
// panels holding N outputs of K inputs, and the tuning's ranges
void check_product(const char* op, const at::Tensor& x, const at::Tensor& wp, int64_t N, int64_t K, int64_t row_block,
                   int64_t k_block, int64_t prefetch_one, int64_t prefetch, int64_t amx_rows, int64_t stream_rows) {
  TORCH_CHECK(gemv_supported(x.scalar_type()), op, "no kernel for ", x.scalar_type(), " on this CPU");
  TORCH_CHECK(x.dim() == 2, op, "x must be 2-D (rows, K)");
  TORCH_CHECK(x.is_contiguous() && wp.is_contiguous(), op, "x and the panels must be contiguous");
  TORCH_CHECK(wp.scalar_type() == x.scalar_type(), op, "x is ", x.scalar_type(), ", the panels are ",
              wp.scalar_type());
  TORCH_CHECK(x.size(1) == K, op, "x has ", x.size(1), " columns, the panels were packed for ", K);
  const std::vector<int64_t> shape = panel_shape(x.scalar_type() == at::kBFloat16, N, K);
  TORCH_CHECK(N >= 1 && wp.sizes() == at::IntArrayRef(shape), op, "panels of shape ", wp.sizes(), " do not hold ", N,
              " outputs of ", K, " inputs (pack them with engine.kernels.pack_panels)");
  TORCH_CHECK(x.size(0) >= 1, op, "at least one row, got ", x.size(0));
  TORCH_CHECK(row_block >= kBlockRows && row_block % kBlockRows == 0, op, "row_block must be a multiple of ",
              kBlockRows, ", got ", row_block);
  TORCH_CHECK(k_block >= 2 && k_block % 2 == 0, op, "k_block must be even and at least 2, got ", k_block);
  TORCH_CHECK(prefetch_one >= 0 && prefetch >= 0, op, "prefetch distances are bytes >= 0, got ", prefetch_one,
              " and ", prefetch);
  TORCH_CHECK(amx_rows >= 0, op, "amx_rows must be >= 0 (0: never), got ", amx_rows);
  TORCH_CHECK(stream_rows >= kPassRowsAvx2 && stream_rows <= kStreamRowsMax, op, "stream_rows must be in [",
              kPassRowsAvx2, ", ", kStreamRowsMax, "], got ", stream_rows);
  TORCH_CHECK(amx_rows == 0 || gemv_amx_supported(), op, "amx_rows=", amx_rows,
              " but this CPU (as allowed) has no AMX bf16 tiles");
}

// x times the panels (N outputs), each panel's finished sums handed to
// finish(isa tag, (T*) nullptr, sums, first row, rows, panel): what the product makes of them
#ifdef MINISERVE_X86
template <typename Finish>
void run_product(const at::Tensor& x, const at::Tensor& wp, int64_t N, int64_t K, int64_t row_block, int64_t k_block,
                 int64_t prefetch_one, int64_t prefetch, bool prefetch_l2, int64_t amx_rows, bool prefetch_one_l2,
                 int64_t stream_rows, Finish&& finish) {
  const int64_t M = x.size(0);
  Prefetch stream;
  stream.ahead = (M > 1 ? prefetch : prefetch_one) / kStepBytes;
  stream.to_l2 = M > 1 ? prefetch_l2 : prefetch_one_l2;
  auto finish_as = [&](auto isa, auto* type) {
    return [&finish, isa, type](const float* part, int64_t r0, int64_t rows, int64_t p) {
      finish(isa, type, part, r0, rows, p);
    };
  };
  if (x.scalar_type() == at::kFloat && cpu_has_avx512()) {
    run_panels<kBlockRows, kStreamRowsMax>(ptr<float>(x), ptr<float>(wp), M, N, K, K, k_block, row_block,
               stream_rows, stream,
               [](auto rows, auto spread, auto&&... args) {
                 panel_f32<decltype(rows)::value, decltype(spread)::value>(args...);
               },
               finish_as(Avx512{}, static_cast<float*>(nullptr)));
  } else if (x.scalar_type() == at::kFloat) {
    // the AVX2 passes work in sub-blocks of kSubSteps, so a k block is whole sub-blocks: two
    // thirds of a 32 KiB L1 (170 steps) would run as 128 + 42, the short one paying every pass's
    // set-up for a third of a sub-block's work. The next block each pass asks for shrinks with it
    // (docs/architecture.md has the figures)
    const int64_t avx2_block = std::max(kSubSteps, k_block / kSubSteps * kSubSteps);
    run_panels<kPassRowsAvx2, kSweepRowsAvx2>(ptr<float>(x), ptr<float>(wp), M, N, K, K, avx2_block, row_block,
               stream_rows, stream,
               [](auto rows, auto spread, auto&&... args) {
                 panel_f32_avx2<decltype(rows)::value, decltype(spread)::value>(args...);
               },
               finish_as(Avx2{}, static_cast<float*>(nullptr)));
#ifdef MINISERVE_AMX
  } else if (amx_rows && M >= amx_rows) {
    run_panels_amx(ptr<uint16_t>(x), ptr<uint16_t>(wp), M, N, K, row_block, stream,
                   finish_as(Avx512{}, static_cast<uint16_t*>(nullptr)));
#endif
  } else {
    run_panels<kBlockRows, kStreamRowsMax>(static_cast<const uint16_t*>(ptr<uint16_t>(x)),
               static_cast<const uint16_t*>(ptr<uint16_t>(wp)), M, N, K, (K + 1) / 2, (k_block + 1) / 2, row_block,
               stream_rows, stream,
               [](auto rows, auto spread, auto&&... args) {
                 panel_bf16<decltype(rows)::value, decltype(spread)::value>(args...);
               },
               finish_as(Avx512{}, static_cast<uint16_t*>(nullptr)));
  }
}
#endif  // MINISERVE_X86

}  // namespace

namespace miniserve_ops {

// prefetch_one / prefetch: how far ahead (bytes) a one-row / a several-row product asks for the
// weight stream (0: not at all), into L2 when prefetch_one_l2 / prefetch_l2 else L1; amx_rows: from
// how many rows a bf16 product runs on AMX tiles (0: never; fp32 has no tile path); stream_rows: up
// to how many rows one sweep of the weights multiplies them all (3-16; each vector loop clamps it
// to its own range: AVX-512 8-16, AVX2 3-6). dispatch.py measures them per machine.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, int64_t N,
               int64_t K, int64_t row_block, int64_t k_block, int64_t prefetch_one, int64_t prefetch,
               bool prefetch_l2, int64_t amx_rows, bool prefetch_one_l2, int64_t stream_rows) {
  check_product("miniserve::gemv: ", x, wp, N, K, row_block, k_block, prefetch_one, prefetch, amx_rows, stream_rows);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "miniserve::gemv: bias must be a contiguous (", N, ",) tensor of x's dtype");
  }
  at::Tensor y = at::empty({x.size(0), N}, x.options());
#ifdef MINISERVE_X86
  void* const out = y.data_ptr();  // once, not per panel
  const void* const b = has_bias ? bias->data_ptr() : nullptr;
  run_product(x, wp, N, K, row_block, k_block, prefetch_one, prefetch, prefetch_l2, amx_rows, prefetch_one_l2,
              stream_rows, [&](auto isa, auto* type, const float* part, int64_t r0, int64_t rows, int64_t p) {
                using T = std::remove_pointer_t<decltype(type)>;
                T* yp = static_cast<T*>(out) + r0 * N;
                if constexpr (std::is_same_v<decltype(isa), Avx2>) {
                  finish_panel_avx2(part, rows, static_cast<const T*>(b), yp, p, N);
                } else {
                  finish_panel<T>(part, rows, static_cast<const T*>(b), yp, p, N);
                }
              });
#endif
  return y;
}

// silu(x · gate) · (x · up) from one product over panels of gate and up interleaved 16 outputs at
// a time (engine.kernels.interleave_gate_up; inter, the MLP's width, a multiple of 16): each panel's
// sums become their 16 outputs where they were summed, so the gate/up outputs never go to memory
// and back, and the activation takes no call of its own. The same bits as gemv then silu_mul
// (finish_silu). The tuning's arguments are gemv's.
at::Tensor gate_up_silu(const at::Tensor& x, const at::Tensor& wp, int64_t inter, int64_t K, int64_t row_block,
                        int64_t k_block, int64_t prefetch_one, int64_t prefetch, bool prefetch_l2, int64_t amx_rows,
                        bool prefetch_one_l2, int64_t stream_rows) {
  const char* op = "miniserve::gate_up_silu: ";
  TORCH_CHECK(inter >= 16 && inter % 16 == 0, op, "inter must be a positive multiple of 16, got ", inter);
  check_product(op, x, wp, 2 * inter, K, row_block, k_block, prefetch_one, prefetch, amx_rows, stream_rows);
  at::Tensor y = at::empty({x.size(0), inter}, x.options());
#ifdef MINISERVE_X86
  void* const out = y.data_ptr();  // once, not per panel
  run_product(x, wp, 2 * inter, K, row_block, k_block, prefetch_one, prefetch, prefetch_l2, amx_rows, prefetch_one_l2,
              stream_rows, [&](auto isa, auto* type, const float* part, int64_t r0, int64_t rows, int64_t p) {
                using T = std::remove_pointer_t<decltype(type)>;
                T* yp = static_cast<T*>(out) + r0 * inter;
                if constexpr (std::is_same_v<decltype(isa), Avx2>) {
                  finish_silu_avx2(part, rows, yp, p, inter);
                } else {
                  finish_silu<T>(part, rows, yp, p, inter);
                }
              });
#endif
  return y;
}

// rows (ids) of the (N, K) weight that `panels` hold, read back out of them: a tied embedding's
// lookup from its lm_head's panels. A row's values lie one k step (fp32) or one k pair (bf16)
// apart, 4 bytes of each 128 (kStepBytes), so a row is K or ceil(K / 2) 4-byte reads one cache
// line each, lines the last step's lm_head product swept out of the caches. Rows are read side by
// side, each asking for its line kAhead steps on: up to (rows x kAhead) misses in flight, where
// torch's indexing of the same elements took them about one at a time (docs/architecture.md has
// the figures).
at::Tensor panel_rows(const at::Tensor& wp, const at::Tensor& ids, int64_t N, int64_t K) {
  const char* op = "miniserve::panel_rows: ";
  TORCH_CHECK(wp.scalar_type() == at::kFloat || wp.scalar_type() == at::kBFloat16, op, "panels are fp32 or bf16, got ",
              wp.scalar_type());
  const bool bf16 = wp.scalar_type() == at::kBFloat16;
  const std::vector<int64_t> shape = panel_shape(bf16, N, K);
  TORCH_CHECK(N >= 1 && K >= 1 && wp.is_contiguous() && wp.sizes() == at::IntArrayRef(shape), op, "panels of shape ",
              wp.sizes(), " do not hold ", N, " rows of ", K, " (pack them with engine.kernels.pack_panels)");
  const int64_t steps = shape[1];  // k steps (fp32) or k pairs (bf16) per panel
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, op, "ids must be a 1-D int64 tensor");
  const at::Tensor idx = ids.contiguous();
  const int64_t n = idx.size(0);
  const int64_t* id = idx.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < N, op, "id ", id[i], " is outside [0, ", N, ")");
  }
  at::Tensor out = at::empty({n, K}, wp.options());
  const int64_t row_bytes = K * wp.element_size(), whole = row_bytes / 4;  // an odd bf16 K ends on 2 bytes
  const char* const base = static_cast<const char*>(wp.const_data_ptr());
  char* const dst = static_cast<char*>(out.data_ptr());
  constexpr int64_t kAhead = 32;
  auto src = [&](int64_t i, int64_t s) {  // id i's 4 bytes at k step s
    return base + ((id[i] / kPanel) * steps * kPanel + id[i] % kPanel) * 4 + s * kStepBytes;
  };
  for (int64_t s = 0; s < whole; ++s) {
    for (int64_t i = 0; i < n; ++i) {
      if (s + kAhead < whole) __builtin_prefetch(src(i, s + kAhead));
      std::memcpy(dst + i * row_bytes + s * 4, src(i, s), 4);
    }
  }
  if (whole * 4 < row_bytes) {
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * row_bytes + whole * 4, src(i, whole), 2);
  }
  return out;
}

}  // namespace miniserve_ops

namespace {

// The features the engine allows every kernel (MINISERVE_CPU_FEATURES): a masked one is absent to
// each *_supported check, as it is to the engine.
void allow_cpu_features(bool avx2, bool avx512, bool avx512_bf16, bool amx_bf16) {
#ifdef MINISERVE_X86
  miniserve_simd::allow_avx2().store(avx2);
  miniserve_simd::allow_avx512().store(avx512);
  miniserve_simd::allow_avx512_bf16().store(avx512_bf16);
  miniserve_simd::allow_amx_bf16().store(amx_bf16);
#endif
}

}  // namespace

TORCH_LIBRARY(miniserve, m) {
  m.def("gemv(Tensor x, Tensor panels, Tensor? bias, int N, int K, int row_block=64, int k_block=256, "
        "int prefetch_one=0, int prefetch=16384, bool prefetch_l2=False, int amx_rows=0, "
        "bool prefetch_one_l2=False, int stream_rows=8) -> Tensor");
  m.def("gate_up_silu(Tensor x, Tensor panels, int inter, int K, int row_block=64, int k_block=256, "
        "int prefetch_one=0, int prefetch=16384, bool prefetch_l2=False, int amx_rows=0, "
        "bool prefetch_one_l2=False, int stream_rows=8) -> Tensor");
  m.def("panel_rows(Tensor panels, Tensor ids, int N, int K) -> Tensor");
  m.def("gemv_supported(ScalarType dtype) -> bool", &gemv_supported);
  m.def("gemv_amx_supported() -> bool", &gemv_amx_supported);
  m.def("allow_cpu_features(bool avx2, bool avx512, bool avx512_bf16, bool amx_bf16=False) -> ()", &allow_cpu_features);
}

TORCH_LIBRARY_IMPL(miniserve, CPU, m) {
  m.impl("gemv", &miniserve_ops::gemv);
  m.impl("gate_up_silu", &miniserve_ops::gate_up_silu);
  m.impl("panel_rows", &miniserve_ops::panel_rows);
}
