// The decoder's layer loop in one C++ call (CPU, fp32 activations, packed fp32 or bf16
// weights). Python dispatch costs ~5-10 us per op and a layer has ~30 of them; here a step is one
// call, the residual stream is updated in place by the fused RMSNorm, and RoPE is applied in place.
//
// Layout of `weights`: kPerLayer tensors per layer, in this order (absent ones are empty):
//   input_norm, qkv_packed, qkv_bias, o_packed, post_norm, gate_up_packed, down_packed,
//   q_norm, k_norm
// followed by the final norm. The attention inputs mirror models/attention.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "kernels.h"

namespace specdecode {
namespace {

constexpr int kPerLayer = 9;

struct Dims {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  double eps;
  bool bf16_activations;
};

inline std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// x [T, n, D] (a strided view is fine) rotated in place with cos/sin [T, D] (half-split form).
void rope_inplace(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t T = x.size(0), n = x.size(1), D = x.size(2), half = D / 2;
  float* base = x.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* ct = c + t * D;
    const float* sn = s + t * D;
    for (int64_t h = 0; h < n; ++h) {
      float* v = base + t * st + h * sh;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * ct[i] - b * sn[i];
        v[i + half] = b * ct[i + half] + a * sn[i + half];
      }
    }
  }
}

constexpr int64_t kDenseQueries = 16;

// Attention of several sequences straight from their cache slots (no gather of the padded
// context): one task per (sequence, kv head) reads each key and value row once for all the
// queries of its head group. q [T, H, D] fp32; caches [Hkv, S, D]; kv_slots [B, L]; query_index /
// query_valid [B, N]; mask [B, 1, N, L] (True = may attend). Returns [T, H * D].
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& cache_k,
                           const at::Tensor& cache_v, const at::Tensor& kv_slots,
                           const at::Tensor& query_index, const at::Tensor& query_valid,
                           const at::Tensor& mask) {
  const at::Tensor q = q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = cache_k.size(0), B = kv_slots.size(0), L = kv_slots.size(1);
  const int64_t N = query_index.size(1), G = H / Hkv;
  TORCH_CHECK(cache_k.stride(2) == 1 && cache_v.stride(2) == 1, "cache rows must be contiguous");
  TORCH_CHECK(mask.numel() == B * N * L, "paged attention needs the [B, 1, N, L] mask");
  at::Tensor out = at::empty({T, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = cache_k.data_ptr<float>();
  const float* vp = cache_v.data_ptr<float>();
  const int64_t ks = cache_k.stride(1), kh = cache_k.stride(0);
  const int64_t vs = cache_v.stride(1), vh = cache_v.stride(0);
  const int64_t* slots = kv_slots.contiguous().data_ptr<int64_t>();
  const at::Tensor qi_t = query_index.contiguous(), qv_t = query_valid.contiguous();
  const at::Tensor mask_t = mask.contiguous();
  const int64_t* qidx = qi_t.data_ptr<int64_t>();
  const bool* qvalid = qv_t.data_ptr<bool>();
  const bool* mk = mask_t.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv;
      int64_t n = 0;
      while (n < N && qvalid[b * N + n]) ++n;
      if (n == 0 || n > kDenseQueries) continue;  // long chunks: dense path below
      // The context ends after the last column any query may see.
      int64_t ctx = 0;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = L - 1; j >= ctx; --j)
          if (mk[(b * N + i) * L + j]) {
            ctx = j + 1;
            break;
          }
      const int64_t R = n * G;  // query rows of this task: (i, g)
      scores.assign(R * ctx, -std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < ctx; ++j) {
        const float* krow = kp + hk * kh + slots[b * L + j] * ks;
        for (int64_t i = 0; i < n; ++i) {
          if (!mk[(b * N + i) * L + j]) continue;
          const int64_t t = qidx[b * N + i];
          for (int64_t g = 0; g < G; ++g) {
            const float* qr = qp + (t * H + hk * G + g) * D;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; ++d) acc += qr[d] * krow[d];
            scores[(i * G + g) * ctx + j] = acc * scale;
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        float* s = scores.data() + r * ctx;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < ctx; ++j) mx = s[j] > mx ? s[j] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < ctx; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < ctx; ++j) s[j] *= inv;
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = qidx[b * N + i];
        for (int64_t g = 0; g < G; ++g) {
          float* o = op + t * H * D + (hk * G + g) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
        }
      }
      for (int64_t j = 0; j < ctx; ++j) {
        const float* vrow = vp + hk * vh + slots[b * L + j] * vs;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = qidx[b * N + i];
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[(i * G + g) * ctx + j];
            if (p == 0.f) continue;
            float* o = op + t * H * D + (hk * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += p * vrow[d];
          }
        }
      }
    }
  });
  // Sequences with many queries (prefill chunks, large trees): gather their context once and
  // use the library's attention, which is vectorised; the loop above suits a few queries.
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = 0;
    while (n < N && qvalid[b * N + n]) ++n;
    if (n <= kDenseQueries) continue;
    const at::Tensor m = mask_t.select(0, b).narrow(1, 0, n);  // [1, n, L]
    const int64_t ctx = m.any(1).nonzero().max().item<int64_t>() + 1;
    const at::Tensor idx = kv_slots.select(0, b).narrow(0, 0, ctx);
    const at::Tensor keys = cache_k.index_select(1, idx).unsqueeze(0);  // [1, Hkv, ctx, D]
    const at::Tensor vals = cache_v.index_select(1, idx).unsqueeze(0);
    const at::Tensor rows = query_index.select(0, b).narrow(0, 0, n);
    const at::Tensor qb = q.index_select(0, rows).transpose(0, 1).unsqueeze(0);  // [1, H, n, D]
    const at::Tensor o = at::scaled_dot_product_attention(
        qb, keys, vals, m.narrow(2, 0, ctx).unsqueeze(0), 0.0, false, std::nullopt, true);
    out.index_copy_(0, rows, o.select(0, 0).transpose(0, 1).reshape({n, H * D}));
  }
  return out;
}

// cache[hk, slot_mapping[t], :] = x[t, hk, :] for k or v ([T, Hkv, D], rows contiguous).
void write_cache(const at::Tensor& cache, const at::Tensor& x, const int64_t* slots) {
  const int64_t T = x.size(0), Hkv = x.size(1), D = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && cache.stride(2) == 1, "cache rows must be contiguous");
  const float* src = x.data_ptr<float>();
  float* dst = cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hkv; ++h)
      std::memcpy(dst + h * cache.stride(0) + slots[t] * cache.stride(1),
                  src + t * x.stride(0) + h * x.stride(1), D * sizeof(float));
}

// A step of one sequence whose context sits in consecutive cache slots, in the shape the paged
// loop takes (B = 1): few queries (decoding, verifying a draft) then run through that loop, which
// sums each query row in the same order whatever the number of queries, instead of the library's
// attention and its per-call overhead.
struct RangeArgs {
  at::Tensor slots, index, valid, mask;  // undefined: use the library's attention
};

RangeArgs range_args(int64_t T, int64_t kv_start, int64_t kv_end, const at::Tensor& mask) {
  RangeArgs r;
  if (kv_start < 0 || T > kDenseQueries) return r;
  const int64_t L = kv_end - kv_start;
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  r.slots = at::arange(kv_start, kv_end, i64).view({1, L});
  r.index = at::arange(T, i64).view({1, T});
  r.valid = at::ones({1, T}, at::TensorOptions().dtype(at::kBool));
  r.mask = mask.numel() ? mask.reshape({1, 1, T, L}).contiguous()
                        : at::ones({1, 1, T, L}, at::TensorOptions().dtype(at::kBool));
  return r;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& cache_k, const at::Tensor& cache_v,
                     const at::Tensor& slot_mapping, int64_t kv_start, int64_t kv_end,
                     const RangeArgs& range, const at::Tensor& kv_slots,
                     const at::Tensor& query_index, const at::Tensor& query_valid,
                     const at::Tensor& mask) {
  // q [T, H, D], k/v [T, Hkv, D]; caches [Hkv, S, D].
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  write_cache(cache_k, k, slots);
  write_cache(cache_v, v, slots);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  if (range.slots.defined())
    return paged_attention(q, cache_k, cache_v, range.slots, range.index, range.valid, range.mask);
  if (kv_start >= 0) {
    auto m = opt(mask);
    auto keys = cache_k.slice(1, kv_start, kv_end).unsqueeze(0);
    auto vals = cache_v.slice(1, kv_start, kv_end).unsqueeze(0);
    auto o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, vals, m, 0.0,
                                              false, std::nullopt, true);
    return o.select(0, 0).transpose(0, 1).reshape({T, H * D});
  }
  return paged_attention(q, cache_k, cache_v, kv_slots, query_index, query_valid, mask);
}

}  // namespace

// Returns {final hidden [T, hidden] (after the last norm), captured layer inputs...}.
std::vector<at::Tensor> forward_layers(
    at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv,
    const at::Tensor& slot_mapping, int64_t kv_start, int64_t kv_end, const at::Tensor& kv_slots,
    const at::Tensor& query_index, const at::Tensor& query_valid, const at::Tensor& mask,
    const std::vector<at::Tensor>& weights, std::vector<int64_t> dims_in, double eps,
    bool bf16_activations, const std::vector<int64_t>& capture) {
  Dims d{dims_in[0], dims_in[1], dims_in[2], dims_in[3], dims_in[4], eps, bf16_activations};
  const int64_t layers = (static_cast<int64_t>(weights.size()) - 1) / kPerLayer;
  const int64_t T = h.size(0);
  const int64_t qs = d.heads * d.head_dim, kvs = d.kv_heads * d.head_dim;
  std::vector<at::Tensor> out(1);
  at::Tensor residual = h.contiguous().clone();
  const at::Tensor slot_map = slot_mapping.contiguous();
  TORCH_CHECK(slot_map.scalar_type() == at::kLong && slot_map.numel() == T, "bad slot_mapping");
  const RangeArgs range = range_args(T, kv_start, kv_end, mask);
  at::Tensor x;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[l * kPerLayer];
    // For l > 0, `x` is the previous MLP output: the fused norm adds it to the residual first.
    x = rmsnorm(l == 0 ? residual : x, w[0], d.eps,
                l == 0 ? std::nullopt : std::optional<at::Tensor>(residual));
    for (auto c : capture)
      if (c == l) out.push_back(residual.clone());  // the residual stream entering layer l
    auto qkv = linear(x, w[1], qs + 2 * kvs, d.hidden, opt(w[2]), d.bf16_activations);
    auto q = qkv.narrow(1, 0, qs).view({T, d.heads, d.head_dim});
    auto k = qkv.narrow(1, qs, kvs).view({T, d.kv_heads, d.head_dim});
    auto v = qkv.narrow(1, qs + kvs, kvs).view({T, d.kv_heads, d.head_dim});
    if (w[7].numel()) {  // Qwen3: RMSNorm per head on q and k
      q = rmsnorm(q.contiguous(), w[7], d.eps, std::nullopt);
      k = rmsnorm(k.contiguous(), w[8], d.eps, std::nullopt);
    }
    rope_inplace(q, cos, sin);
    rope_inplace(k, cos, sin);
    auto attn = attention(q, k, v, kv.select(0, l).select(0, 0), kv.select(0, l).select(0, 1),
                          slot_map, kv_start, kv_end, range, kv_slots, query_index,
                          query_valid, mask);
    auto o = linear(attn.contiguous(), w[3], d.hidden, qs, std::nullopt, d.bf16_activations);
    x = rmsnorm(o, w[4], d.eps, residual);  // residual += o
    auto gu = linear(x, w[5], 2 * d.inter, d.hidden, std::nullopt, d.bf16_activations);
    x = linear(silu_mul(gu), w[6], d.hidden, d.inter, std::nullopt, d.bf16_activations);
  }
  out[0] = rmsnorm(x, weights.back(), d.eps, residual);  // residual += last MLP output
  return out;
}

}  // namespace specdecode
