// Small-M linear kernels (y = x @ W^T + b) for x86 CPUs with AVX-512 or AVX2 + FMA.
//
// Decoding multiplies a handful of activation rows by a large weight, so the
// cost is streaming W from DRAM once per call.  Weights are pre-packed (by
// specdecode/kernels.py) so that each inner-loop step loads one contiguous
// 64-byte line for 16 consecutive outputs:
//
//   fp32: [ceil(N/16), K, 16]          w[b][k][i]    = W[16 b + i, k]
//   bf16: groups of G = kGroup blocks (4 with AVX-512, 2 with AVX2; the last one may be
//         smaller, g = its size),
//         each stored as [ceil(K/2), g, 16, 2]:
//         group[j][c][i][h] = W[16 (4 q + c) + i, 2 j + h] for group q
//
//   int8 (weight-only, fp32 activations): groups of G blocks like bf16, each stored as
//         [ceil(K/4), g, 4, 16]:
//         group[j][c][h][i] = round(W[16 (G q + c) + i, 4 j + h] / scale[n]), followed by
//         the per-output fp32 scales (max |W[n, :]| / 127), padded to whole blocks.
//         Weight-only quantisation for drafters (their proposals never touch exactness):
//         half the bytes of bf16; each k widens with one sign-extending load and a convert.
//
//   int8 dot (AVX512_VNNI CPUs; a uint8 tensor marks this layout): groups of G blocks, each
//         [ceil(K/4), g, 16, 4]: group[j][c][i][h] = q[16 (G q + c) + i, 4 j + h], followed by
//         the per-output fp32 scales and the per-output int32 sums of q, padded to whole
//         blocks.  The activations are quantised per row too (x ~ xq * sx, xq in [-127, 127],
//         fed as xq + 128 in [1, 255]) and one vpdpbusd multiplies 4 k's of 16 outputs:
//         y = (sum (xq + 128) q - 128 sum q) * sx * scale + bias.  Weight-only int8 at M = 1
//         is bound by widening each weight to fp32 (~15-28 GB/s on Zen 4); this is not.
//
//   int4 dot (AVX512_VNNI CPUs; an int16 tensor marks this layout): K padded to groups of
//         kI4Group k's with one fp32 scale per (output, k group) (q = round(w / scale) in
//         [-8, 7], stored as u = q + 8 in [0, 15]); groups of G blocks, each
//         [Kp/8, g, 16, 4] bytes, byte h of lane i at step j = u[i, 8 j + h] | u[i, 8 j + 4 + h] << 4;
//         then the scales [Kp / kI4Group, Npad].  A step unpacks the low and high nibbles
//         (one and, one shift + and) into two vpdpbusd (the unsigned operand) against the
//         per-row int8-quantised activations (the signed one); each k group's int32 sum is
//         exact, sum u xq = sum q xq + 8 sum xq, so it is corrected by the row's 8 sum xq and
//         scaled in fp32.  Drafters only, like int8.
//
// Padding is zero.  The bf16 blocks of a group (one micro-tile's worth) are
// interleaved per k-step so that a tile streams one contiguous run of memory
// instead of 4 separate ones: at small M this is bandwidth-bound, and one
// sequential stream keeps the hardware prefetchers far ahead (~1.25x faster
// per core on Zen 4 than 4 panel streams).  The tensor keeps the shape
// [ceil(N/16), ceil(K/2), 16, 2].
//
// A bf16 32-bit lane holds the (k, k+1) pair of one output:
// with fp32 activations both halves widen to fp32 with one shift / one mask,
// with bf16 activations (AVX512_BF16 only) the pair feeds one vdpbf16ps.
//
// The layout is the same for both instruction sets: a 16-output block is one
// zmm register with AVX-512 and two ymm registers with AVX2 (`kVecs`).
//
// Each output is accumulated in one sequential chain over k, independent of
// M and of the thread split, so a row's result is bitwise identical whatever
// the batch (speculative verification matches single-token decoding).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>

#include "kernels.h"

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "specdecode kernels need AVX-512 or AVX2 + FMA"
#endif

namespace specdecode {

// ---------------------------------------------------------------------------
// The few vector operations the kernels use, for one register width.
namespace simd {
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vf = __m512;
using vi = __m512i;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vi loadi(const void* p) { return _mm512_loadu_si512(p); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf bf16_lo(vi v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
// 16 int8 at p -> 16 fp32
inline vf i8_load(const void* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))));
}
inline vf bf16_hi(vi v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
// The first min(n, lanes) lanes; the rest read as zero / are not written.
inline vf load_n(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u), p);
}
inline void store_n(float* p, vf v, int64_t n) {
  _mm512_mask_storeu_ps(p, n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u), v);
}
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vreduce_max(vf v) { return _mm512_reduce_max_ps(v); }
// exp(x) per lane: 2^n * 2^f, |f| <= 1/2, degree-7 polynomial (rel. err ~1e-7).
inline vf exp2_split(vf t, vf* n) {
  *n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_sub_ps(t, *n);
}
inline vf exp_scale(vf p, vf n, vf) { return _mm512_scalef_ps(p, n); }
// NaN stays NaN (min/max return their second operand when one is NaN).
inline vf clamp(vf x, float lo, float hi) {
  return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x));
}
constexpr float kExpLo = -128.0f, kExpHi = 128.0f;
#else
constexpr int kLanes = 8;
using vf = __m256;
using vi = __m256i;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vi loadi(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf bf16_lo(vi v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
// 8 int8 at p -> 8 fp32
inline vf i8_load(const void* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p))));
}
inline vf bf16_hi(vi v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline __m256i lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf load_n(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(n));
}
inline void store_n(float* p, vf v, int64_t n) {
  if (n >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, lane_mask(n), v);
}
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float vreduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf exp2_split(vf t, vf* n) {
  *n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_sub_ps(t, *n);
}
// p * 2^n with n in [-126, 127] built in the exponent field; `x` (the unclamped input) maps
// overflow to +inf and underflow to 0, as the AVX-512 scalef does.
inline vf exp_scale(vf p, vf n, vf x) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  vf r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  r = _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(88.5f), _CMP_GT_OQ));
  return _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
}
inline vf clamp(vf x, float lo, float hi) {
  return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x));
}
constexpr float kExpLo = -87.0f, kExpHi = 88.5f;
#endif
}  // namespace simd

constexpr int64_t kBlock = 16;      // outputs per packed block (one 64-byte line)
constexpr int kVecs = kBlock / simd::kLanes;  // registers per block
constexpr int kMaxRows = 8;         // activation rows per micro-tile (table size)
constexpr int kMaxBlocks = 4;       // output blocks per micro-tile
#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif
// bf16 blocks interleaved per step (kernels.py reads it through bf16_group()): one micro-tile's
// width, 4 blocks with AVX-512, 2 with AVX2 (whose 16 registers hold 2 rows x 2 blocks).
constexpr int64_t kGroup = kAvx512 ? 4 : 2;

enum class Kind { kF32, kBf16, kBf16Dot, kI8, kI8Dot, kI4Dot };
constexpr int64_t kI4Group = 128;  // k's per int4 scale (kernels.py reads it: int4_group())

// Software prefetch of the weight stream at 2+ rows (see `run`); switchable for A/B
// measurements.
static bool g_prefetch = true;
void set_prefetch(bool on) { g_prefetch = on; }
constexpr int64_t kPrefetchSteps = 32;  // k-steps ahead (AVX-512 fp32 and vdpbf16ps tiles)
constexpr int64_t kPrefetchAhead = 1024;  // AVX2 fp32: bytes ahead in each panel (16 k-steps)

// Blocks per micro-tile for MR rows, keeping the accumulators (MR * CB * kVecs) within the
// register file: 32 zmm with AVX-512 (MR * CB <= 16), 16 ymm with AVX2 (up to 12 accumulators:
// 6 rows x 1 block, plus the block's 2 weight vectors and a broadcast).
constexpr int blocks_for_rows(int mr) {
  if (kAvx512) return mr <= 4 ? 4 : 2;
  return mr <= 1 ? 4 : (mr <= 2 ? 2 : 1);
}


// Rows per micro-tile.  Each row costs one broadcast per weight vector, and
// broadcasts compete with FMAs, so wide-but-short tiles win once the loop is
// compute-bound; re-reading a tile's weights for the next row chunk hits
// cache.  (Measured on Zen 4: 16x1 tiles run at ~60% of 8x2; the bf16 path,
// with two FMAs per loaded pair, prefers 4x4.)
//
// A bf16 tile always spans its whole packed group, so it reads the group's memory in one
// contiguous stream (a narrower tile would read 64 of every 256 bytes and leave the rest to
// another pass from DRAM); with AVX2 that is 2 blocks x 2 rows, further rows re-read it from L2.
//
// AVX-512 bf16 takes 5 rows (20 accumulators + 8 converted weight vectors of 32 registers): a
// verification of 5 tokens (4 drafts + the root) then streams its weights once instead of
// running a second, 1-row chunk (measured on Zen 4, Qwen2.5-1.5B forward: 5 tokens cost 1.17x
// of 1 with 4-row tiles).
// int8 tiles span their group too; one widened weight vector is live at a time, so AVX-512
// fits 6 rows x 4 blocks of accumulators.
// vdpbf16ps (kBf16Dot) needs no widening: 4 raw weight vectors + 6 x 4 accumulators.
template <Kind KIND>
constexpr int max_rows() {
  if (!kAvx512) return KIND == Kind::kBf16 || KIND == Kind::kI8 ? 2 : 6;
  if (KIND == Kind::kBf16) return 5;
  if (KIND == Kind::kI4Dot) return 2;  // int32 and fp32 accumulators + 8 unpacked vectors
  return KIND == Kind::kI8 || KIND == Kind::kBf16Dot || KIND == Kind::kI8Dot ? 6 : 8;
}

// Output blocks per micro-tile of `mr` rows: bf16 (kBf16) and int8 tiles span the whole packed
// group.
template <Kind KIND>
constexpr int tile_blocks(int mr) {
  return KIND == Kind::kF32 ? blocks_for_rows(mr) : kGroup;
}

// Arguments shared by all micro-tiles.  `x` is fp32 [M, ldx] for kF32/kBf16/kI8, packed
// bf16 pairs (uint32) [M, ldx] for kBf16Dot, quads of uint8 xq + 128 (uint32) for kI8Dot and
// of int8 xq for kI4Dot.
struct TileArgs {
  const void* x;
  int64_t ldx;
  int64_t steps;  // K for fp32, ceil(K/2) for bf16, ceil(K/4) for int8, Kp/8 for int4
  float* y;
  int64_t ldy;
  int64_t N;
  const float* bias;
  int64_t prefetch = 0;  // bytes ahead of its loads that a tile prefetches each step (0: none)
  const float* scale = nullptr;  // int8: per-output scales
  const int32_t* wsum = nullptr;  // int8 dot: per-output sums of the quantised weights
  const float* xscale = nullptr;  // int8 dot: per-row activation scales
  const float* gscale = nullptr;  // int4: scales [k groups, Npad]
  int64_t ldg = 0;                // int4: Npad
  const int32_t* xsum = nullptr;  // int4: per row and k group, sum of xq [M, ldxs]
  int64_t ldxs = 0;
};

// `wblock` points at the tile's first block at step 0; step s of block c is at
// wblock + s * sstride_bytes + c * (fp32: one [K, 16] panel; bf16: 64 bytes).
template <Kind KIND, int MR, int CB>
void tile(const TileArgs& a, const void* wblock, int64_t sstride_bytes, int64_t n0) {
  using namespace simd;
  constexpr int V = kVecs;
  vf acc[MR][CB][V];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < CB; ++c)
      for (int v = 0; v < V; ++v) acc[m][c][v] = zero();
  const int64_t steps = a.steps;
  // One step consumes 64 bytes of weights per block.  fp32 blocks are whole
  // [K, 16] panels one after another; bf16 blocks of a group are interleaved
  // per step, so a tile streams one contiguous run of memory.
  const int64_t bstride_bytes = KIND == Kind::kF32 ? steps * 64 : 64;
  const char* wb = static_cast<const char*>(wblock);

  for (int64_t s = 0; s < steps; ++s) {
    const char* p0 = wb + s * (KIND == Kind::kF32 ? 64 : sstride_bytes);
    if constexpr (KIND == Kind::kF32 && kAvx512) {
      // 32 registers: load the tile's weight vectors, then one broadcast per row.
      const float* x = static_cast<const float*>(a.x);
      vf wv[CB];
      if (a.prefetch)
        for (int c = 0; c < CB; ++c) _mm_prefetch(p0 + c * bstride_bytes + a.prefetch, _MM_HINT_T0);
      for (int c = 0; c < CB; ++c) wv[c] = load(reinterpret_cast<const float*>(p0 + c * bstride_bytes));
      for (int m = 0; m < MR; ++m) {
        const vf xv = set1(x[m * a.ldx + s]);
        for (int c = 0; c < CB; ++c) acc[m][c][0] = fmadd(xv, wv[c], acc[m][c][0]);
      }
    } else if constexpr (KIND == Kind::kF32) {
      // 16 registers: the tile's weight vectors stay in registers (CB * V of them), one
      // broadcast per row.  Zen 3 retires 2 FMAs but 3 loads a cycle, so an FMA that reads its
      // weight from memory once per row makes the loop load-bound (~60% of peak at 4 rows).
      const float* x = static_cast<const float*>(a.x);
      vf wv[CB][V];
      if (a.prefetch)
        for (int c = 0; c < CB; ++c) _mm_prefetch(p0 + c * bstride_bytes + a.prefetch, _MM_HINT_T0);
      for (int c = 0; c < CB; ++c)
        for (int v = 0; v < V; ++v)
          wv[c][v] = load(reinterpret_cast<const float*>(p0 + c * bstride_bytes) + v * kLanes);
      for (int m = 0; m < MR; ++m) {
        const vf xv = set1(x[m * a.ldx + s]);
        for (int c = 0; c < CB; ++c)
          for (int v = 0; v < V; ++v) acc[m][c][v] = fmadd(xv, wv[c][v], acc[m][c][v]);
      }
    } else if constexpr (KIND == Kind::kBf16 && kAvx512) {
      const float* x = static_cast<const float*>(a.x);
      vf w0[CB], w1[CB];
      for (int c = 0; c < CB; ++c) {
        const vi wi = loadi(p0 + c * bstride_bytes);
        w0[c] = bf16_lo(wi);  // k = 2s
        w1[c] = bf16_hi(wi);  // k = 2s + 1
      }
      for (int m = 0; m < MR; ++m) {
        const vf x0 = set1(x[m * a.ldx + 2 * s]);
        const vf x1 = set1(x[m * a.ldx + 2 * s + 1]);
        for (int c = 0; c < CB; ++c) {
          acc[m][c][0] = fmadd(x0, w0[c], acc[m][c][0]);
          acc[m][c][0] = fmadd(x1, w1[c], acc[m][c][0]);
        }
      }
    } else if constexpr (KIND == Kind::kI8) {
      // 64 bytes per block and step: 4 k's x 16 outputs; k = 4s + h
      const float* x = static_cast<const float*>(a.x);
      for (int h = 0; h < 4; ++h)
        for (int c = 0; c < CB; ++c)
          for (int v = 0; v < V; ++v) {
            const vf w = i8_load(p0 + c * bstride_bytes + h * kBlock + v * kLanes);
            for (int m = 0; m < MR; ++m)
              acc[m][c][v] = fmadd(set1(x[m * a.ldx + 4 * s + h]), w, acc[m][c][v]);
          }
    } else if constexpr (KIND == Kind::kBf16) {
      const float* x = static_cast<const float*>(a.x);
      vf x0[MR], x1[MR];
      for (int m = 0; m < MR; ++m) {
        x0[m] = set1(x[m * a.ldx + 2 * s]);
        x1[m] = set1(x[m * a.ldx + 2 * s + 1]);
      }
      for (int c = 0; c < CB; ++c)
        for (int v = 0; v < V; ++v) {
          const vi wi = loadi(p0 + c * bstride_bytes + v * kLanes * 4);
          const vf w0 = bf16_lo(wi);  // k = 2s
          const vf w1 = bf16_hi(wi);  // k = 2s + 1
          for (int m = 0; m < MR; ++m) {
            acc[m][c][v] = fmadd(x0[m], w0, acc[m][c][v]);
            acc[m][c][v] = fmadd(x1[m], w1, acc[m][c][v]);
          }
        }
    } else {
      // kBf16Dot / kI8Dot: one 32-bit lane per output holds its k pair (quad); one broadcast
      // x lane per row, one dot instruction per block (the int32 sums live in the fp32 regs)
#if defined(__AVX512F__)
      const uint32_t* x = static_cast<const uint32_t*>(a.x);
      __m512i wv[CB];
      if (a.prefetch)  // the group's blocks are one contiguous run: its lines a step ahead
        for (int c = 0; c < CB; ++c) _mm_prefetch(p0 + a.prefetch + c * 64, _MM_HINT_T0);
      for (int c = 0; c < CB; ++c) wv[c] = _mm512_loadu_si512(p0 + c * bstride_bytes);
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(x[m * a.ldx + s]));
        for (int c = 0; c < CB; ++c) {
          if constexpr (KIND == Kind::kI8Dot) {
#if defined(__AVX512VNNI__)
            acc[m][c][0] = _mm512_castsi512_ps(
                _mm512_dpbusd_epi32(_mm512_castps_si512(acc[m][c][0]), xv, wv[c]));
#endif
          } else {
#if defined(__AVX512BF16__)
            acc[m][c][0] = _mm512_dpbf16_ps(acc[m][c][0], (__m512bh)xv, (__m512bh)wv[c]);
#endif
          }
        }
      }
#endif
    }
  }

  for (int c = 0; c < CB; ++c)
    for (int v = 0; v < V; ++v) {
      const int64_t n = n0 + c * kBlock + v * kLanes;
      if (n >= a.N) continue;
      const vf b = a.bias ? load_n(a.bias + n, a.N - n) : zero();
      if constexpr (KIND == Kind::kI8Dot) {
#if defined(__AVX512VNNI__)
        // the int32 sums, less 128 x the weight sums (exact), then the two scales
        const vf sc = load_n(a.scale + n, a.N - n);
        const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(a.wsum + n), 7);
        for (int m = 0; m < MR; ++m) {
          const vf dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_castps_si512(acc[m][c][v]), off));
          store_n(a.y + m * a.ldy + n, fmadd(dot, mul(sc, set1(a.xscale[m])), b), a.N - n);
        }
#endif
      } else if constexpr (KIND == Kind::kI8) {
        const vf sc = load_n(a.scale + n, a.N - n);
        for (int m = 0; m < MR; ++m)
          store_n(a.y + m * a.ldy + n, fmadd(acc[m][c][v], sc, b), a.N - n);
      } else {
        for (int m = 0; m < MR; ++m) store_n(a.y + m * a.ldy + n, add(acc[m][c][v], b), a.N - n);
      }
    }
}

// int4 dot micro-tile (layout at the top): per k group, int32 sums over its steps, then one
// correction and fp32 scale per output; the epilogue applies the row scale.
template <int MR, int CB>
void tile_i4(const TileArgs& a, const void* wblock, int64_t sstride_bytes, int64_t n0) {
#if defined(__AVX512VNNI__)
  constexpr int64_t kGroupSteps = kI4Group / 8;
  const uint32_t* x = static_cast<const uint32_t*>(a.x);
  const char* wb = static_cast<const char*>(wblock);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 accf[MR][CB];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < CB; ++c) accf[m][c] = _mm512_setzero_ps();
  const int64_t groups = a.steps / kGroupSteps;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[MR][CB];
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < CB; ++c) acc[m][c] = _mm512_setzero_si512();
    for (int64_t s = g * kGroupSteps; s < (g + 1) * kGroupSteps; ++s) {
      const char* p0 = wb + s * sstride_bytes;
      __m512i lo[CB], hi[CB];
      for (int c = 0; c < CB; ++c) {
        const __m512i v = _mm512_loadu_si512(p0 + c * 64);
        lo[c] = _mm512_and_si512(v, low4);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512i x0 = _mm512_set1_epi32(static_cast<int32_t>(x[m * a.ldx + 2 * s]));
        const __m512i x1 = _mm512_set1_epi32(static_cast<int32_t>(x[m * a.ldx + 2 * s + 1]));
        for (int c = 0; c < CB; ++c) {
          acc[m][c] = _mm512_dpbusd_epi32(acc[m][c], lo[c], x0);
          acc[m][c] = _mm512_dpbusd_epi32(acc[m][c], hi[c], x1);
        }
      }
    }
    for (int c = 0; c < CB; ++c) {
      const __m512 sc = _mm512_loadu_ps(a.gscale + g * a.ldg + n0 + c * kBlock);
      for (int m = 0; m < MR; ++m) {
        const __m512i corr = _mm512_set1_epi32(8 * a.xsum[m * a.ldxs + g]);
        accf[m][c] = _mm512_fmadd_ps(
            sc, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][c], corr)), accf[m][c]);
      }
    }
  }
  for (int c = 0; c < CB; ++c) {
    const int64_t n = n0 + c * kBlock;
    if (n >= a.N) continue;
    const __m512 b = a.bias ? simd::load_n(a.bias + n, a.N - n) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
      simd::store_n(a.y + m * a.ldy + n,
                    _mm512_fmadd_ps(accf[m][c], _mm512_set1_ps(a.xscale[m]), b), a.N - n);
  }
#endif
}

using TileFn = void (*)(const TileArgs&, const void*, int64_t, int64_t);

template <Kind KIND, int MR, int CB>
constexpr TileFn tile_fn() {
  if constexpr (KIND == Kind::kI4Dot)
    return &tile_i4<MR, CB>;
  else
    return &tile<KIND, MR, CB>;
}

// Table of micro-tiles indexed by [rows - 1][blocks - 1].
template <Kind KIND>
struct TileTable {
  TileFn fn[kMaxRows][kMaxBlocks];

  constexpr TileTable() : fn{} { fill(std::make_integer_sequence<int, kMaxRows>{}); }

  template <int... Rs>
  constexpr void fill(std::integer_sequence<int, Rs...>) {
    (fill_row<Rs + 1>(), ...);
  }

  template <int MR>
  constexpr void fill_row() {
    if constexpr (MR <= max_rows<KIND>()) {
      fn[MR - 1][0] = tile_fn<KIND, MR, 1>();
      fn[MR - 1][1] = tile_fn<KIND, MR, 2>();
      if constexpr (tile_blocks<KIND>(MR) >= 3) fn[MR - 1][2] = tile_fn<KIND, MR, 3>();
      if constexpr (tile_blocks<KIND>(MR) >= 4) fn[MR - 1][3] = tile_fn<KIND, MR, 4>();
    }
  }
};

template <Kind KIND>
TileFn lookup(int mr, int cb) {
  static constexpr TileTable<KIND> table;
  return table.fn[mr - 1][cb - 1];
}

// Splits the output blocks into one contiguous range per thread (at least
// 256 KiB of weights each); each thread walks its range in groups of up to CB
// blocks and, within a group, all row chunks, so the weight re-reads for
// M > rows-per-tile hit cache rather than DRAM.  bf16 ranges are whole
// packed groups of kGroup blocks.
template <Kind KIND>
void run(const TileArgs& a, int64_t M, const char* w, int64_t nblocks) {
  const int64_t block_bytes = a.steps * 64;
  constexpr int64_t G = KIND == Kind::kF32 ? 1 : kGroup;
  const int64_t nunits = (nblocks + G - 1) / G;
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / (block_bytes * G));
  at::parallel_for(0, nunits, grain, [&](int64_t u0, int64_t u1) {
    constexpr int rows = max_rows<KIND>();
    const int64_t b1 = std::min(nblocks, u1 * G);
    // fp32: a group spans as many blocks as the widest tile of its row chunks takes, so a
    // short last chunk (M = 8: 6 + 2 rows) runs 2 blocks wide with enough accumulators to hide
    // the FMA latency, instead of 1 block at half the FMA rate.
    const int64_t tail = M % rows == 0 ? std::min<int64_t>(M, rows) : M % rows;
    const int cb_full = KIND == Kind::kF32
        ? std::max(blocks_for_rows(static_cast<int>(std::min<int64_t>(M, rows))),
                   blocks_for_rows(static_cast<int>(tail)))
        : static_cast<int>(G);
    // With a few rows a tile issues its loads too slowly for the hardware prefetcher to keep
    // DRAM busy (the out-of-order window holds fewer steps ahead as each step does more work):
    // prefetch each panel ahead at 2+ rows (M = 1 keeps the hardware prefetcher busy by itself
    // and measured slower with it on Zen 3).  AVX2 fp32 (2..rows rows): 1 KiB ahead, forward +
    // LM head of SmolLM2 over 4 tokens ~10% faster on Zen 3.  AVX-512 fp32 and vdpbf16ps:
    // kPrefetchSteps steps ahead; on Zen 4 (SmolLM2, same measure, the two interleaved) bf16
    // 4 / 6 / 8 tokens ~6 / 10 / 13% faster, fp32 ~5 / 6 / 12%; 4x the distance was slower
    // at 2-4 rows in fp32 (its 4 panels are 4 streams), a quarter of it gained little.
    const bool pf_rows = g_prefetch && M >= 2;
    int64_t pf_bytes = 0;
    if (KIND == Kind::kF32 && !kAvx512 && M <= rows) pf_bytes = kPrefetchAhead;
    if (KIND == Kind::kF32 && kAvx512) pf_bytes = kPrefetchSteps * 64;
    for (int64_t b = u0 * G; b < b1;) {
      const int cb = static_cast<int>(std::min<int64_t>(cb_full, b1 - b));
      // fp32: block c starts at its panel; bf16: group g holds its cb blocks
      // interleaved, one 64-byte line each per step.
      const int64_t sstride = KIND == Kind::kF32 ? 64 : cb * 64;
      const int64_t pf = !pf_rows                    ? 0
                         : KIND == Kind::kBf16Dot ? kPrefetchSteps * sstride
                                                  : pf_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int mr = static_cast<int>(std::min<int64_t>(rows, M - m0));
        const int step = std::min(cb, tile_blocks<KIND>(mr));
        TileArgs sub = a;
        sub.x = static_cast<const char*>(a.x) + m0 * a.ldx * 4;
        sub.y = a.y + m0 * a.ldy;
        if (a.xscale) sub.xscale = a.xscale + m0;
        if (a.xsum) sub.xsum = a.xsum + m0 * a.ldxs;
        sub.prefetch = pf;
        for (int c = 0; c < cb; c += step) {
          const int n = std::min(step, cb - c);
          const char* wc =
              KIND == Kind::kF32 ? w + (b + c) * block_bytes : w + b * block_bytes + c * 64;
          lookup<KIND>(mr, n)(sub, wc, sstride, (b + c) * kBlock);
        }
      }
      b += cb;
    }
  });
}


// ---------------------------------------------------------------------------
// AMX (Intel AMX-BF16): the bf16-activation projections as 16-row tile products.
//
// The packed bf16 layout is already AMX's VNNI layout for the second operand: 16 k-steps of
// one 16-output block (64 bytes each, a pair per output) form one B tile, rows `sstride`
// bytes apart (the group's blocks are interleaved per step).  The activations, packed in bf16
// pairs [rows, steps], give the A tile (up to 16 rows x 16 pairs); one TDPBF16PS per block
// and 32 k's accumulates a [rows, 16] fp32 C tile.  Verifying up to 16 tokens then costs one
// pass over the weights like decoding one (vdpbf16ps pays one instruction per row and block).
// Each C row depends only on its own A row, so a row's result is the same whatever M; it is
// not bitwise the vdpbf16ps path's, so a matrix takes AMX for every M or for none (K a
// multiple of 32).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define SPECDECODE_AMX 1
#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define SPECDECODE_AMX_I8 1
#endif
#endif

static bool g_amx = true;  // switchable for A/B measurements (kernels.set_amx)
// int8 / int4 weights on AMX from this many rows on: both paths give the same bits, so the
// choice is speed's.  Measured on a 2-core Sapphire Rapids-class VM (Qwen2.5-0.5B shapes):
// int8 AMX 0.9x of vpdpbusd at 1 row, 1.2-1.4x at 2-4, 2-3.6x at 8-32; int4 (whose nibbles
// AMX must unpack first) 0.45-0.7x at 1 row, about even at 4, 1.2-1.7x from 8 rows on.
static int64_t g_amx_i8_rows = 2;
static int64_t g_amx_i4_rows = 6;
// Sets the thresholds; returns the previous ones.
std::pair<int64_t, int64_t> set_amx_rows(int64_t i8_rows, int64_t i4_rows) {
  const std::pair<int64_t, int64_t> before{g_amx_i8_rows, g_amx_i4_rows};
  g_amx_i8_rows = i8_rows;
  g_amx_i4_rows = i4_rows;
  return before;
}

bool amx_compiled() {
#if defined(SPECDECODE_AMX)
  return true;
#else
  return false;
#endif
}

// Linux hands out the 8 KiB of tile state only on request (once per process).
bool amx_permitted() {
#if defined(SPECDECODE_AMX)
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

void set_amx(bool on) { g_amx = on; }
bool amx_active() { return g_amx && amx_compiled() && amx_permitted(); }

// Whether the bf16-activation path of a [N, K] bf16 weight runs on AMX here.
inline bool use_amx(int64_t K) { return K % 32 == 0 && amx_active(); }

// Whether the W8A8 path of a [N, K] int8 weight does (AMX-INT8; K a multiple of 64).
inline bool use_amx_i8(int64_t K) {
#if defined(SPECDECODE_AMX_I8)
  return K % 64 == 0 && amx_active();
#else
  return false;
#endif
}

#if defined(SPECDECODE_AMX)
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0-3: C, one per block of the group ([rows, 16] fp32 / int32); tmm4: A ([rows, 64 bytes]);
// tmm5-7: B ([16, 64 bytes]).  Loaded by each thread before its tiles.
inline void load_tile_config(int rows) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t < 5 ? rows : 16;
  }
  _tile_loadconfig(&cfg);
}

inline void zero_c_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// The group's cb C tiles into a [16, 64] buffer of 4-byte values (block c at column 16 c).
inline void store_c_tiles(void* buf, int cb) {
  char* p = static_cast<char*>(buf);
  _tile_stored(0, p, 256);
  if (cb > 1) _tile_stored(1, p + 64, 256);
  if (cb > 2) _tile_stored(2, p + 128, 256);
  if (cb > 3) _tile_stored(3, p + 192, 256);
}

// The output blocks in groups of kGroup split over the threads (at least 256 KiB of weights
// each), each thread with its tile configuration for min(M, 16) rows: body(u0, u1) runs groups
// [u0, u1).
template <class Body>
void amx_parallel(int64_t M, int64_t nblocks, int64_t block_bytes, const Body& body) {
  const int64_t nunits = (nblocks + kGroup - 1) / kGroup;
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / (block_bytes * kGroup));
  const int rows = static_cast<int>(std::min<int64_t>(M, 16));
  at::parallel_for(0, nunits, grain, [&](int64_t u0, int64_t u1) {
    load_tile_config(rows);
    body(u0, u1);
    _tile_release();
  });
}

// gcc's tile intrinsics take literal register numbers.
#define SPECDECODE_AMX_BLOCK(OP, C, B, ptr, stride) \
  do {                                              \
    _tile_loadd(B, ptr, stride);                    \
    OP(C, 4, B);                                    \
  } while (0)

// The group's up-to-4 blocks over all k, for A rows at x (row stride ldx_bytes).
#define SPECDECODE_AMX_GROUP(OP)                                             \
  for (int64_t s = 0; s < steps; s += 16) {                                  \
    _tile_loadd(4, xr + s * 4, ldx_bytes);                                   \
    const char* ws = wg + s * sstride;                                       \
    SPECDECODE_AMX_BLOCK(OP, 0, 5, ws, sstride);                             \
    if (cb > 1) SPECDECODE_AMX_BLOCK(OP, 1, 6, ws + 64, sstride);            \
    if (cb > 2) SPECDECODE_AMX_BLOCK(OP, 2, 7, ws + 128, sstride);           \
    if (cb > 3) SPECDECODE_AMX_BLOCK(OP, 3, 5, ws + 192, sstride);           \
  }

// KIND kBf16Dot: x is bf16 pairs, TDPBF16PS; kI8Dot: x is uint8 quads (xq + 128) against the
// signed int8 weights, TDPBUSD, and the epilogue is the vpdpbusd path's (the int32 sums are
// exact, so the two paths agree bitwise).  x has `rows` rows, M padded to a multiple of 16 when
// M > 16; a.steps % 16 == 0.
template <Kind KIND>
void run_amx(const TileArgs& a, int64_t M, const char* w, int64_t nblocks) {
  const int64_t steps = a.steps;
  const int64_t block_bytes = steps * 64;
  const int64_t ldx_bytes = a.ldx * 4;
  constexpr int64_t G = kGroup;
  amx_parallel(M, nblocks, block_bytes, [&](int64_t u0, int64_t u1) {
    alignas(64) float cbuf[16 * 64];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u * G;
      const int cb = static_cast<int>(std::min<int64_t>(G, nblocks - b));
      const int64_t sstride = cb * 64;
      const char* wg = w + b * block_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        zero_c_tiles();
        const char* xr = static_cast<const char*>(a.x) + m0 * ldx_bytes;
        if constexpr (KIND == Kind::kI8Dot) {
#if defined(SPECDECODE_AMX_I8)
          SPECDECODE_AMX_GROUP(_tile_dpbusd)
#endif
        } else {
          SPECDECODE_AMX_GROUP(_tile_dpbf16ps)
        }
        store_c_tiles(cbuf, cb);
        const int mr = static_cast<int>(std::min<int64_t>(16, M - m0));
        for (int c = 0; c < cb; ++c) {
          const int64_t n = (b + c) * kBlock;
          if (n >= a.N) break;
          const int64_t left = a.N - n;
          const __m512 bv = a.bias ? simd::load_n(a.bias + n, left) : _mm512_setzero_ps();
          if constexpr (KIND == Kind::kI8Dot) {
            const __m512 sc = simd::load_n(a.scale + n, left);
            const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(a.wsum + n), 7);
            for (int m = 0; m < mr; ++m) {
              const __m512i acc = _mm512_load_si512(cbuf + m * 64 + c * 16);
              const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, off));
              simd::store_n(a.y + (m0 + m) * a.ldy + n,
                            _mm512_fmadd_ps(dot, _mm512_mul_ps(sc, _mm512_set1_ps(a.xscale[m0 + m])), bv),
                            left);
            }
          } else {
            for (int m = 0; m < mr; ++m)
              simd::store_n(a.y + (m0 + m) * a.ldy + n,
                            _mm512_add_ps(_mm512_load_ps(cbuf + m * 64 + c * 16), bv), left);
          }
        }
      }
    }
  });
}
#endif

#if defined(SPECDECODE_AMX_I8)
// int4 weights on AMX: per k group (128 k's = 16 steps) the group's blocks are unpacked once
// into byte tiles (low nibbles: quad 2j, high nibbles: quad 2j + 1 of step j, the VNNI order),
// then every 16-row chunk of the signed int8 activations multiplies them with TDPBSUD; the
// int32 group sums, their correction and fp32 scaling are the vpdpbusd path's, in its order,
// so the two paths agree bitwise.
void run_amx_i4(const TileArgs& a, int64_t M, const char* w, int64_t nblocks) {
  constexpr int64_t kGroupSteps = kI4Group / 8;
  const int64_t steps = a.steps, groups = steps / kGroupSteps;
  const int64_t block_bytes = steps * 64;
  const int64_t ldx_bytes = a.ldx * 4;
  constexpr int64_t G = kGroup;
  const int64_t mpad = (M + 15) / 16 * 16;
  amx_parallel(M, nblocks, block_bytes, [&](int64_t u0, int64_t u1) {
    alignas(64) uint8_t bbuf[2][G][16 * 64];  // the group's byte tiles: [half][block]
    alignas(64) int32_t cbuf[16 * 64];
    std::vector<__m512> accf(mpad * G);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u * G;
      const int cb = static_cast<int>(std::min<int64_t>(G, nblocks - b));
      const int64_t sstride = cb * 64;
      const char* wg = w + b * block_bytes;
      std::fill(accf.begin(), accf.end(), _mm512_setzero_ps());
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t r = 0; r < kGroupSteps; ++r) {
          const char* p0 = wg + (g * kGroupSteps + r) * sstride;
          uint8_t* row = &bbuf[r / 8][0][0] + (r % 8) * 128;
          for (int c = 0; c < cb; ++c) {
            const __m512i v = _mm512_loadu_si512(p0 + c * 64);
            _mm512_store_si512(row + c * 16 * 64, _mm512_and_si512(v, low4));
            _mm512_store_si512(row + c * 16 * 64 + 64,
                               _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
          }
        }
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
          zero_c_tiles();
          for (int h = 0; h < 2; ++h) {
            _tile_loadd(4, static_cast<const char*>(a.x) + m0 * ldx_bytes + (g * 32 + h * 16) * 4,
                        ldx_bytes);
            SPECDECODE_AMX_BLOCK(_tile_dpbsud, 0, 5, bbuf[h][0], 64);
            if (cb > 1) SPECDECODE_AMX_BLOCK(_tile_dpbsud, 1, 6, bbuf[h][1], 64);
            if (cb > 2) SPECDECODE_AMX_BLOCK(_tile_dpbsud, 2, 7, bbuf[h][2], 64);
            if (cb > 3) SPECDECODE_AMX_BLOCK(_tile_dpbsud, 3, 5, bbuf[h][3], 64);
          }
          store_c_tiles(cbuf, cb);
          const int mr = static_cast<int>(std::min<int64_t>(16, M - m0));
          for (int c = 0; c < cb; ++c) {
            const __m512 sc = _mm512_loadu_ps(a.gscale + g * a.ldg + (b + c) * kBlock);
            for (int m = 0; m < mr; ++m) {
              const __m512i corr = _mm512_set1_epi32(8 * a.xsum[(m0 + m) * a.ldxs + g]);
              __m512& acc = accf[(m0 + m) * G + c];
              acc = _mm512_fmadd_ps(
                  sc, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(cbuf + m * 64 + c * 16), corr)),
                  acc);
            }
          }
        }
      }
      for (int c = 0; c < cb; ++c) {
        const int64_t n = (b + c) * kBlock;
        if (n >= a.N) break;
        const __m512 bv = a.bias ? simd::load_n(a.bias + n, a.N - n) : _mm512_setzero_ps();
        for (int64_t m = 0; m < M; ++m)
          simd::store_n(a.y + m * a.ldy + n,
                        _mm512_fmadd_ps(accf[m * G + c], _mm512_set1_ps(a.xscale[m]), bv), a.N - n);
      }
    }
  });
}
#endif

int64_t bf16_group() { return kGroup; }
int64_t int4_group() { return kI4Group; }

bool int8_dot_compiled() {
#if defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// Rows of x (fp32, row stride ldx) quantised for vpdpbusd: per row sx = max|x| / 127 and
// xq = round(x * (1 / sx)) + 128 (uint8; K padded with 128, i.e. xq = 0, to `steps` quads).
// A row with a NaN or infinity gets sx = NaN, so its outputs are NaN as on the fp32 path.
void quantize_rows_u8(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t steps,
                      std::vector<uint32_t>& xq, std::vector<float>& sx) {
  xq.assign(M * steps, 0x80808080u);
  sx.assign(M, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    auto* qr = reinterpret_cast<uint8_t*>(xq.data() + m * steps);
    float mx = 0.f;
    bool nan = false;  // max drops NaN operands: tracked apart
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 vmx = _mm512_setzero_ps();
    __mmask16 unordered = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 v = _mm512_loadu_ps(xr + k);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vmx = _mm512_max_ps(vmx, _mm512_abs_ps(v));
    }
    mx = _mm512_reduce_max_ps(vmx);
    nan = unordered != 0;
#endif
    for (; k < K; ++k) {
      nan = nan || std::isnan(xr[k]);
      mx = std::max(mx, std::fabs(xr[k]));
    }
    if (nan || !std::isfinite(mx)) {
      sx[m] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float scale = mx > 0.f ? std::max(mx / 127.f, std::numeric_limits<float>::min()) : 1.f;
    const float inv = 1.f / scale;
    sx[m] = scale;
    k = 0;
#if defined(__AVX512F__)
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i bias = _mm512_set1_epi32(128);
    for (; k + 16 <= K; k += 16) {
      const __m512i q = _mm512_add_epi32(
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + k), vinv)), bias);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k), _mm512_cvtusepi32_epi8(q));
    }
#endif
    for (; k < K; ++k)
      qr[k] = static_cast<uint8_t>(std::lrintf(xr[k] * inv) + 128);
  }
}

bool bf16_dot_compiled() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// y[M, N] (row stride ldy) = x[M, K] (fp32, row stride ldx) @ W^T + bias, W packed as described
// at the top, fp32 activations: the decoder loop's entry, with no tensor ops per call.
void linear_rows(const float* x, int64_t ldx, int64_t M, const at::Tensor& w, int64_t N,
                 int64_t K, const float* bias, float* y, int64_t ldy, bool bf16_activations) {
  if (M <= 0 || N <= 0) return;
  const bool is_bf16 = w.scalar_type() == at::kBFloat16;
  if (bf16_activations && is_bf16 && bf16_dot_compiled()) {
    // x rounded to bf16 (nearest even), packed in (k, k+1) pairs for vdpbf16ps / AMX (whose
    // A tiles read 16 rows: more rows than that are padded to a multiple of 16)
    const int64_t steps = (K + 1) / 2;
    const bool amx = use_amx(K);
    const int64_t rows = amx && M > 16 ? (M + 15) / 16 * 16 : M;
    std::vector<uint32_t> xb(rows * steps, 0u);
    auto* h = reinterpret_cast<uint16_t*>(xb.data());
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * ldx;
      uint16_t* hr = h + m * 2 * steps;
      int64_t k = 0;
#if defined(__AVX512BF16__)
      for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hr + k),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
#endif
      for (; k < K; ++k) {
        uint32_t bits;
        std::memcpy(&bits, xr + k, 4);
        hr[k] = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
      }
    }
#if defined(SPECDECODE_AMX)
    if (amx) {
      const TileArgs a{xb.data(), steps, steps, y, ldy, N, bias};
      run_amx<Kind::kBf16Dot>(a, M, static_cast<const char*>(w.data_ptr()), (N + kBlock - 1) / kBlock);
      return;
    }
#endif
    const TileArgs a{xb.data(), steps, steps, y, ldy, N, bias};
    run<Kind::kBf16Dot>(a, M, static_cast<const char*>(w.data_ptr()), (N + kBlock - 1) / kBlock);
    return;
  }
  if (w.scalar_type() == at::kShort) {  // int4 dot layout
    TORCH_CHECK(int8_dot_compiled(), "built without AVX512_VNNI");
    const int64_t ng = (K + kI4Group - 1) / kI4Group, quads = ng * kI4Group / 4;
    const int64_t nblocks = (N + kBlock - 1) / kBlock;
    std::vector<uint32_t> xq;
    std::vector<float> sx;
    quantize_rows_u8(x, ldx, M, K, quads, xq, sx);
    std::vector<int32_t> xs(M * ng, 0);  // sum of xq per row and k group
    for (int64_t m = 0; m < M; ++m) {
      auto* qr = reinterpret_cast<int8_t*>(xq.data() + m * quads);
      for (int64_t k = 0; k < ng * kI4Group; ++k) {
        qr[k] = static_cast<int8_t>(static_cast<uint8_t>(qr[k]) ^ 0x80u);  // xq + 128 -> xq
        xs[m * ng + k / kI4Group] += qr[k];
      }
    }
    const char* wp = static_cast<const char*>(w.data_ptr());
    TileArgs a{xq.data(), quads, quads / 2, y, ldy, N, bias};
    a.gscale = reinterpret_cast<const float*>(wp + nblocks * (quads / 2) * 64);
    a.ldg = nblocks * kBlock;
    a.xscale = sx.data();
    a.xsum = xs.data();
    a.ldxs = ng;
#if defined(SPECDECODE_AMX_I8)
    if (amx_active() && g_amx_i4_rows <= M) {
      if (M > 16) xq.resize((M + 15) / 16 * 16 * quads, 0u);  // whole A tiles (xq = 0)
      a.x = xq.data();
      run_amx_i4(a, M, wp, nblocks);
      return;
    }
#endif
    run<Kind::kI4Dot>(a, M, wp, nblocks);
    return;
  }
  if (w.scalar_type() == at::kByte) {  // int8 dot layout
    TORCH_CHECK(int8_dot_compiled(), "built without AVX512_VNNI");
    const int64_t steps = (K + 3) / 4, nblocks = (N + kBlock - 1) / kBlock;
    std::vector<uint32_t> xq;
    std::vector<float> sx;
    quantize_rows_u8(x, ldx, M, K, steps, xq, sx);
    const char* wp = static_cast<const char*>(w.data_ptr());
    TileArgs a{xq.data(), steps, steps, y, ldy, N, bias};
    a.scale = reinterpret_cast<const float*>(wp + nblocks * steps * 64);
    a.wsum = reinterpret_cast<const int32_t*>(wp + nblocks * (steps + 1) * 64);
    a.xscale = sx.data();
#if defined(SPECDECODE_AMX_I8)
    if (use_amx_i8(K) && M >= g_amx_i8_rows) {
      if (M > 16) xq.resize((M + 15) / 16 * 16 * steps, 0x80808080u);  // whole A tiles
      a.x = xq.data();
      run_amx<Kind::kI8Dot>(a, M, wp, nblocks);
      return;
    }
#endif
    run<Kind::kI8Dot>(a, M, wp, nblocks);
    return;
  }
  const bool is_i8 = w.scalar_type() == at::kChar;
  const int64_t per = is_i8 ? 4 : (is_bf16 ? 2 : 1);  // k's per step
  const int64_t steps = (K + per - 1) / per;
  std::vector<float> padded;
  if (steps * per != K) {  // the bf16 / int8 kernels read x in whole steps
    const int64_t kp = steps * per;
    padded.assign(M * kp, 0.f);
    for (int64_t m = 0; m < M; ++m) std::copy(x + m * ldx, x + m * ldx + K, &padded[m * kp]);
    x = padded.data();
    ldx = kp;
  }
  TileArgs a{x, ldx, steps, y, ldy, N, bias};
  const char* wp = static_cast<const char*>(w.data_ptr());
  const int64_t nblocks = (N + kBlock - 1) / kBlock;
  if (is_i8) {
    a.scale = reinterpret_cast<const float*>(wp + nblocks * steps * 64);
    run<Kind::kI8>(a, M, wp, nblocks);
  } else if (is_bf16) {
    run<Kind::kBf16>(a, M, wp, nblocks);
  } else {
    run<Kind::kF32>(a, M, wp, nblocks);
  }
}

// The tensor entry for layouts that go through linear_rows (which prepares the activations
// itself: int8 / int4 dot layouts, bf16 on AMX): fp32 rows in, x's dtype out.
static at::Tensor linear_through_rows(const at::Tensor& x, const at::Tensor& w, int64_t N,
                                      int64_t K, const std::optional<at::Tensor>& bias,
                                      bool bf16_activations) {
  TORCH_CHECK(!bias || (bias->numel() == N && bias->device().is_cpu()),
              "bias must have N elements");
  const at::Tensor x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  auto y = at::empty({x2.size(0), N}, x2.options());
  linear_rows(x2.data_ptr<float>(), K, x2.size(0), w, N, K,
              b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), N,
              bf16_activations);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  y = y.view(sizes);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// y[..., N] = x[..., K] @ W^T + bias, W packed as described at the top.
// `bf16_activations` (bf16 weights only) rounds x to bf16 and uses vdpbf16ps.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K,
                  const std::optional<at::Tensor>& bias, bool bf16_activations) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "specdecode kernels are CPU-only");
  TORCH_CHECK(x.is_floating_point(), "x must be a floating-point tensor");
  TORCH_CHECK(K > 0 && x.dim() >= 1 && x.size(-1) == K, "x last dim must be K = ", K);
  TORCH_CHECK(w.is_contiguous() && w.size(0) * kBlock >= N, "bad packed weight");
  if (w.scalar_type() == at::kByte || w.scalar_type() == at::kShort) {
    // int8 / int4 dot layouts: fp32 rows through linear_rows
    const int64_t ng = (K + kI4Group - 1) / kI4Group;
    TORCH_CHECK(w.scalar_type() == at::kByte
                    ? w.numel() == w.size(0) * ((K + 3) / 4 + 2) * 64
                    : w.numel() * 2 == w.size(0) * (ng * kI4Group / 8 + ng) * 64,
                "packed weight does not match K");
    return linear_through_rows(x, w, N, K, bias, false);
  }
  const bool is_bf16 = w.scalar_type() == at::kBFloat16;
  const bool is_i8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(is_bf16 || is_i8 || w.scalar_type() == at::kFloat,
              "packed weight must be fp32, bf16 or int8");
  const int64_t per = is_i8 ? 4 : (is_bf16 ? 2 : 1);
  const int64_t steps = (K + per - 1) / per;
  TORCH_CHECK(w.numel() == (is_i8 ? w.size(0) * (steps + 1) * 64
                                  : w.size(0) * steps * kBlock * (is_bf16 ? 2 : 1)),
              "packed weight does not match K");
  TORCH_CHECK(!bf16_activations || is_bf16, "bf16_activations needs bf16 weights");
  TORCH_CHECK(!bf16_activations || bf16_dot_compiled(), "built without AVX512_BF16");

  auto x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  if (bf16_activations && use_amx(K)) {  // rows padded for the A tiles by linear_rows
    return linear_through_rows(x, w, N, K, bias, true);
  }
  const int64_t kpad = per * steps;
  at::Tensor xa;  // activations in kernel format
  if (bf16_activations) {
    xa = x2.to(at::kBFloat16);
  } else {
    xa = x2.to(at::kFloat);
  }
  if (kpad != K) xa = at::constant_pad_nd(xa, {0, kpad - K});
  xa = xa.contiguous();

  auto y = at::empty({M, N}, x2.options().dtype(at::kFloat));
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->numel() == N && bias->device().is_cpu(), "bias must have N elements");
    b = bias->to(at::kFloat).contiguous();
  }
  if (M > 0 && N > 0) {
    TileArgs a{xa.data_ptr(), bf16_activations ? steps : kpad, steps, y.data_ptr<float>(), N, N,
               b.defined() ? b.data_ptr<float>() : nullptr};
    const char* wp = static_cast<const char*>(w.data_ptr());
    const int64_t nblocks = (N + kBlock - 1) / kBlock;
    if (is_i8) {
      a.scale = reinterpret_cast<const float*>(wp + nblocks * steps * 64);
      run<Kind::kI8>(a, M, wp, nblocks);
    } else if (!is_bf16) {
      run<Kind::kF32>(a, M, wp, nblocks);
    } else if (bf16_activations) {
      run<Kind::kBf16Dot>(a, M, wp, nblocks);
    } else {
      run<Kind::kBf16>(a, M, wp, nblocks);
    }
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  y = y.view(sizes);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// ---------------------------------------------------------------------------
// Fused elementwise ops (fp32), cutting per-op dispatch in a decode step.

// exp(x) per lane: 2^n * 2^f, |f| <= 1/2, degree-7 polynomial (rel. err ~1e-7).
inline simd::vf vexp(simd::vf x) {
  using namespace simd;
  const vf xc = clamp(x, kExpLo, kExpHi);
  const vf t = mul(xc, set1(1.4426950408889634f));
  vf n;
  const vf f = exp2_split(t, &n);
  // Coefficients ln2^i / i! of 2^f.
  vf p = set1(1.5252733804059841e-05f);
  p = fmadd(p, f, set1(1.5403530393381609e-04f));
  p = fmadd(p, f, set1(1.3333558146428443e-03f));
  p = fmadd(p, f, set1(9.6181291076284772e-03f));
  p = fmadd(p, f, set1(5.5504108664821580e-02f));
  p = fmadd(p, f, set1(2.4022650695910071e-01f));
  p = fmadd(p, f, set1(6.9314718055994531e-01f));
  p = fmadd(p, f, set1(1.0f));
  return exp_scale(p, n, x);
}

void dot_rows(const float* const* q, int64_t R, const float* k, int64_t D, float scale, float* out,
              int64_t ldo) {
  using namespace simd;
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    vf a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
    for (int64_t d = 0; d < D; d += kLanes) {
      const vf kv = load_n(k + d, D - d);
      a0 = fmadd(load_n(q[r] + d, D - d), kv, a0);
      a1 = fmadd(load_n(q[r + 1] + d, D - d), kv, a1);
      a2 = fmadd(load_n(q[r + 2] + d, D - d), kv, a2);
      a3 = fmadd(load_n(q[r + 3] + d, D - d), kv, a3);
    }
    out[r * ldo] = reduce_add(a0) * scale;
    out[(r + 1) * ldo] = reduce_add(a1) * scale;
    out[(r + 2) * ldo] = reduce_add(a2) * scale;
    out[(r + 3) * ldo] = reduce_add(a3) * scale;
  }
  for (; r < R; ++r) {
    vf a = zero();
    for (int64_t d = 0; d < D; d += kLanes) a = fmadd(load_n(q[r] + d, D - d), load_n(k + d, D - d), a);
    out[r * ldo] = reduce_add(a) * scale;
  }
}

namespace {
// NV vectors of out (from d0) as register accumulators over all j.
template <int NV>
void weighted_block(const float* p, const float* const* v, int64_t n, int64_t D, int64_t d0,
                    float* out) {
  using namespace simd;
  vf acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = zero();
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] == 0.f) continue;
    const vf pj = set1(p[j]);
    for (int c = 0; c < NV; ++c) {
      const int64_t d = d0 + c * kLanes;
      acc[c] = fmadd(pj, load_n(v[j] + d, D - d), acc[c]);
    }
  }
  for (int c = 0; c < NV; ++c) store_n(out + d0 + c * kLanes, acc[c], D - d0 - c * kLanes);
}
}  // namespace

void weighted_rows(const float* p, const float* const* v, int64_t n, int64_t D, float* out) {
  using namespace simd;
  constexpr int64_t kBlockVecs = 8;
  for (int64_t d0 = 0; d0 < D; d0 += kBlockVecs * kLanes) {
    switch ((std::min(D - d0, kBlockVecs * kLanes) + kLanes - 1) / kLanes) {
      case 1: weighted_block<1>(p, v, n, D, d0, out); break;
      case 2: weighted_block<2>(p, v, n, D, d0, out); break;
      case 3: weighted_block<3>(p, v, n, D, d0, out); break;
      case 4: weighted_block<4>(p, v, n, D, d0, out); break;
      case 5: weighted_block<5>(p, v, n, D, d0, out); break;
      case 6: weighted_block<6>(p, v, n, D, d0, out); break;
      case 7: weighted_block<7>(p, v, n, D, d0, out); break;
      default: weighted_block<8>(p, v, n, D, d0, out); break;
    }
  }
}

void softmax_row(float* s, int64_t n) {
  using namespace simd;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  vf vmx = set1(-kInf);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) vmx = vmax(vmx, load(s + j));
  float mx = vreduce_max(vmx);
  for (; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  const vf m = set1(mx);
  vf sum = zero();
  for (j = 0; j < n; j += kLanes) {
    store_n(s + j, vexp(sub(load_n(s + j, n - j), m)), n - j);
    sum = add(sum, load_n(s + j, n - j));  // lanes past n read as zero
  }
  const vf inv = set1(1.f / reduce_add(sum));
  for (j = 0; j < n; j += kLanes) store_n(s + j, mul(load_n(s + j, n - j), inv), n - j);
}

// Rows per parallel task so that tiny decode-sized inputs stay single-threaded.
int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_elems));
}

void check_f32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be an fp32 CPU tensor");
}

// out[..., I] = silu(gate_up[..., :I]) * gate_up[..., I:].
void silu_mul_rows(const float* src, float* dst, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, row_grain(2 * I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = src + r * 2 * I;
      const float* u = g + I;
      float* o = dst + r * I;
      for (int64_t i = 0; i < I; i += simd::kLanes) {
        using namespace simd;
        const vf gv = load_n(g + i, I - i);
        const vf uv = load_n(u + i, I - i);
        const vf den = add(set1(1.0f), vexp(sub(zero(), gv)));
        store_n(o + i, mul(div(gv, den), uv), I - i);
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  check_f32_cpu(gate_up_in, "gate_up");
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t two_i = gate_up.size(-1);
  TORCH_CHECK(two_i % 2 == 0, "last dim of gate_up must be even");
  const int64_t I = two_i / 2;
  const int64_t rows = I > 0 ? gate_up.numel() / two_i : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gate_up.options());
  silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, I);
  return out;
}

// RMSNorm of `rows` rows of H (x row r at x + r * ldx), HF-style: (x * rsqrt(mean(x^2) + eps))
// * weight, written to out (row stride ldo; may be x itself). With `res` (rows of H, contiguous),
// first res += x in place and normalize the sum.
void rmsnorm_rows(const float* xs, int64_t ldx, float* res, const float* w, float* dst,
                  int64_t ldo, int64_t rows, int64_t H, double eps) {
  at::parallel_for(0, rows, row_grain(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = xs + r * ldx;
      using namespace simd;
      if (res) {
        float* rr = res + r * H;
        for (int64_t i = 0; i < H; i += kLanes)
          store_n(rr + i, add(load_n(rr + i, H - i), load_n(src + i, H - i)), H - i);
        src = rr;
      }
      vf ss = zero();
      for (int64_t i = 0; i < H; i += kLanes) {
        const vf v = load_n(src + i, H - i);
        ss = fmadd(v, v, ss);
      }
      const float mean = reduce_add(ss) / static_cast<float>(H);
      const vf scale = set1(1.0f / std::sqrt(mean + static_cast<float>(eps)));
      float* o = dst + r * ldo;
      for (int64_t i = 0; i < H; i += kLanes)
        store_n(o + i, mul(mul(load_n(src + i, H - i), scale), load_n(w + i, H - i)), H - i);
    }
  });
}

// RMSNorm over the last dim, HF-style: (x * rsqrt(mean(x^2) + eps)) * weight.
// With `residual`, first does residual += x in place and normalizes the sum.
at::Tensor rmsnorm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps,
                   const std::optional<at::Tensor>& residual) {
  check_f32_cpu(x_in, "x");
  check_f32_cpu(weight_in, "weight");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.numel() == H, "weight must have ", H, " elements");
  if (residual) {
    check_f32_cpu(*residual, "residual");
    TORCH_CHECK(residual->is_contiguous(), "residual must be contiguous (updated in place)");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual shape must match x");
  }
  const int64_t rows = H > 0 ? x.numel() / H : 0;
  auto out = at::empty_like(x);
  rmsnorm_rows(x.data_ptr<float>(), H, residual ? residual->data_ptr<float>() : nullptr,
               weight.data_ptr<float>(), out.data_ptr<float>(), H, rows, H, eps);
  return out;
}

}  // namespace specdecode

namespace py = pybind11;
using namespace specdecode;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_prefetch", &set_prefetch, "software prefetch at 2+ rows on/off (A/B measurements)");
  m.def("linear", &linear, "y = x @ W^T (+ bias) with a packed fp32/bf16/int8 weight", py::arg("x"),
        py::arg("w"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(),
        py::arg("bf16_activations") = false);
  m.def("forward_layers", &forward_layers,
        "the decoder's layer loop in one call (see decoder.cpp)");
  m.def("silu_mul", &silu_mul, "silu(gate_up[..., :I]) * gate_up[..., I:] (fp32)",
        py::arg("gate_up"));
  m.def("rmsnorm", &rmsnorm, "RMSNorm (fp32); with residual, residual += x first (in place)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("bf16_group", &bf16_group, "bf16 blocks interleaved per k-step in the packed layout");
  m.def("int4_group", &int4_group, "k's per int4 scale in the int4 dot layout");
  m.def("int8_dot_compiled", &int8_dot_compiled, "whether vpdpbusd support was compiled in");
  m.def("amx_compiled", &amx_compiled, "whether AMX-BF16 support was compiled in");
  m.def("amx_active", &amx_active,
        "whether bf16-activation projections (K a multiple of 32) run on AMX tiles here");
  m.def("set_amx_rows", &set_amx_rows, "int8 / int4 weights use AMX from these many rows on; returns the previous pair");
  m.def("set_amx", &set_amx, "AMX on/off for A/B measurements (when compiled and permitted)");
  m.def("bf16_dot_compiled", &bf16_dot_compiled, "whether vdpbf16ps support was compiled in");
}
