// The decoder's layer loop in one C++ call (CPU, fp32 activations, packed fp32 or bf16
// weights). Python dispatch costs ~5-10 us per op and a layer has ~30 of them; here a step is one
// call. The loop works on raw rows in buffers allocated once per call (no tensor op per layer on
// the decode path): the residual stream is updated in place by the fused RMSNorm, RoPE is applied
// in place, and keys/values are copied straight into their cache slots.
//
// Layout of `weights`: kPerLayer tensors per layer, in this order (absent ones are empty):
//   input_norm, qkv_packed, qkv_bias, o_packed, post_norm, gate_up_packed, down_packed,
//   q_norm, k_norm
// followed by the final norm. The attention inputs mirror models/attention.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
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

// Sequences with more new tokens than this (prefill chunks, large trees) use the library's
// attention over their gathered context; fewer go through the direct loop below. Only the direct
// loop sums a row as decoding does: a verified tree of more than this many nodes keeps greedy
// tokens but its logprobs may differ from token-by-token decoding by a few fp32 ulps (~3e-5).
constexpr int64_t kDenseQueries = 16;

struct Dims {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  double eps;
  bool bf16_activations;
};

inline const float* fptr(const at::Tensor& t) {
  return t.numel() ? t.data_ptr<float>() : nullptr;
}

// Rows x[t, h, :] (t stride st, head stride sh) rotated in place with cos/sin [T, D] (half-split).
void rope_rows(float* base, int64_t T, int64_t n, int64_t D, int64_t st, int64_t sh,
               const float* c, const float* s) {
  const int64_t half = D / 2;
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

// One layer's KV cache: [Hkv, S, D] for k and for v, rows contiguous.
struct CacheView {
  float* k;
  float* v;
  int64_t head_stride, slot_stride;
};

// Where the step's queries look: B sequences, each with up to N new tokens (query_index into the
// T new tokens, query_valid False on padding) and a context of up to L cache slots; mask
// [B, N, L] (True = may attend) or null (every query sees the whole context).
struct Layout {
  int64_t B, N, L;
  const int64_t* slots;  // [B, L], or null for one sequence in consecutive slots from `first`
  int64_t first;
  const int64_t* qidx;  // [B, N], or null: query i is token i
  const bool* qvalid;   // [B, N], or null: all valid
  const bool* mask;
  int64_t count(int64_t b) const {
    if (!qvalid) return N;
    int64_t n = 0;
    while (n < N && qvalid[b * N + n]) ++n;
    return n;
  }
  int64_t slot(int64_t b, int64_t j) const { return slots ? slots[b * L + j] : first + j; }
  int64_t query(int64_t b, int64_t i) const { return qidx ? qidx[b * N + i] : i; }
  bool sees(int64_t b, int64_t i, int64_t j) const { return !mask || mask[(b * N + i) * L + j]; }
};

// Attention of sequences with few new tokens straight from their cache slots: one task per
// (sequence, kv head) reads each key and value row once for all the queries of its head group,
// and each query row is summed in the same order whatever the number of queries and wherever a
// tree's mask hides columns (so verifying a draft matches decoding it token by token, bit for
// bit). q rows at q + t * ldq (heads of D contiguous);
// out [T, H * D]. Sequences with more than kDenseQueries new tokens are skipped (dense path).
void direct_attention(const float* qp, int64_t ldq, int64_t H, int64_t D, const CacheView& c,
                      int64_t Hkv, const Layout& lay, float* op) {
  const int64_t G = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, lay.B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> qrows, krows, vrows, vsel;
    std::vector<int64_t> seen;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv;
      const int64_t n = lay.count(b);
      if (n == 0 || n > kDenseQueries) continue;
      // The context ends after the last column any query may see.
      int64_t ctx = lay.mask ? 0 : lay.L;
      if (lay.mask)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = lay.L - 1; j >= ctx; --j)
            if (lay.sees(b, i, j)) {
              ctx = j + 1;
              break;
            }
      const int64_t R = n * G;  // query rows of this task: (i, g)
      qrows.resize(R);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < G; ++g)
          qrows[i * G + g] = qp + lay.query(b, i) * ldq + (hk * G + g) * D;
      krows.resize(ctx);
      vrows.resize(ctx);
      for (int64_t j = 0; j < ctx; ++j) {
        krows[j] = c.k + hk * c.head_stride + lay.slot(b, j) * c.slot_stride;
        vrows[j] = c.v + hk * c.head_stride + lay.slot(b, j) * c.slot_stride;
      }
      scores.resize(R * ctx);
      // (a masked column's score is computed and never read: each row keeps its own below)
      for (int64_t j = 0; j < ctx; ++j)
        dot_rows(qrows.data(), R, krows[j], D, scale, scores.data() + j, ctx);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r / G, g = r % G;
        float* row = scores.data() + r * ctx;
        const float* const* vis = vrows.data();
        int64_t m = ctx;
        if (lay.mask) {
          // The columns this query sees, packed in order: the softmax's vector sum then adds
          // them in the lanes decoding the same token alone would (a tree's masked siblings
          // between them would shift every later key to another lane, and its rounding).
          if (g == 0) {
            seen.clear();
            for (int64_t j = 0; j < ctx; ++j)
              if (lay.sees(b, i, j)) seen.push_back(j);
            vsel.resize(seen.size());
            for (size_t k = 0; k < seen.size(); ++k) vsel[k] = vrows[seen[k]];
          }
          m = static_cast<int64_t>(seen.size());
          for (int64_t k = 0; k < m; ++k) row[k] = row[seen[k]];  // (seen[k] >= k)
          vis = vsel.data();
        }
        softmax_row(row, m);
        weighted_rows(row, vis, m, D, op + lay.query(b, i) * H * D + (hk * G + g) * D);
      }
    }
  });
}

// Sequences with many new tokens: gather their context once and use the library's attention,
// which is vectorised. q [T, H, D] (a view), caches [Hkv, S, D], out [T, H * D].
void dense_attention(const at::Tensor& q, const at::Tensor& cache_k, const at::Tensor& cache_v,
                     const Layout& lay, const at::Tensor& mask, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  for (int64_t b = 0; b < lay.B; ++b) {
    const int64_t n = lay.count(b);
    if (n <= kDenseQueries) continue;
    if (!lay.slots) {  // one sequence in consecutive slots; mask [1, 1, n, L] or none
      auto keys = cache_k.slice(1, lay.first, lay.first + lay.L).unsqueeze(0);
      auto vals = cache_v.slice(1, lay.first, lay.first + lay.L).unsqueeze(0);
      std::optional<at::Tensor> m;
      if (mask.numel()) m = mask;
      auto o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, vals, m,
                                                0.0, false, std::nullopt, true);
      out.copy_(o.select(0, 0).transpose(0, 1).reshape({n, H * D}));
      continue;
    }
    const at::Tensor mb = mask.select(0, b).narrow(1, 0, n);  // [1, n, L]
    const int64_t ctx = mb.any(1).nonzero().max().item<int64_t>() + 1;
    const at::Tensor idx =
        at::from_blob(const_cast<int64_t*>(lay.slots + b * lay.L), {ctx}, i64);
    const at::Tensor keys = cache_k.index_select(1, idx).unsqueeze(0);  // [1, Hkv, ctx, D]
    const at::Tensor vals = cache_v.index_select(1, idx).unsqueeze(0);
    const at::Tensor rows =
        at::from_blob(const_cast<int64_t*>(lay.qidx + b * lay.N), {n}, i64);
    const at::Tensor qb = q.index_select(0, rows).transpose(0, 1).unsqueeze(0);  // [1, H, n, D]
    const at::Tensor o = at::scaled_dot_product_attention(
        qb, keys, vals, mb.narrow(2, 0, ctx).unsqueeze(0), 0.0, false, std::nullopt, true);
    out.index_copy_(0, rows, o.select(0, 0).transpose(0, 1).reshape({n, H * D}));
  }
}

}  // namespace

// Returns {final hidden [T, hidden] (after the last norm), captured layer inputs...}; layer
// `layers` (one past the last) is the residual stream the last layer leaves, before the norm.
// `attn_in` (non-empty: [T, K0] fp32) is the first layer's attention input as given, instead of
// input_norm(h): an EAGLE head's one layer reads [norm(embedding); norm(hidden)] (K0 = 2 hidden)
// or its fc output unnormalised, with `h` as the residual; its qkv weight is packed with K0.
std::vector<at::Tensor> forward_layers(
    at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv,
    const at::Tensor& slot_mapping, int64_t kv_start, int64_t kv_end, const at::Tensor& kv_slots,
    const at::Tensor& query_index, const at::Tensor& query_valid, const at::Tensor& mask_in,
    const std::vector<at::Tensor>& weights, std::vector<int64_t> dims_in, double eps,
    bool bf16_activations, const std::vector<int64_t>& capture, const at::Tensor& attn_in) {
  Dims d{dims_in[0], dims_in[1], dims_in[2], dims_in[3], dims_in[4], eps, bf16_activations};
  const int64_t layers = (static_cast<int64_t>(weights.size()) - 1) / kPerLayer;
  const int64_t T = h.size(0), Hd = d.hidden, D = d.head_dim;
  const int64_t qs = d.heads * D, kvs = d.kv_heads * D, W = qs + 2 * kvs, I = d.inter;
  TORCH_CHECK(h.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(kv.dim() == 5 && kv.stride(4) == 1, "kv cache must be [layers, 2, Hkv, S, D]");
  const at::Tensor slot_map = slot_mapping.contiguous();
  TORCH_CHECK(slot_map.scalar_type() == at::kLong && slot_map.numel() == T, "bad slot_mapping");
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const at::Tensor mask = mask_in.numel() ? mask_in.contiguous() : mask_in;
  const at::Tensor ain = attn_in.numel() ? attn_in.contiguous() : attn_in;
  TORCH_CHECK(!ain.numel() || (ain.scalar_type() == at::kFloat && ain.dim() == 2 &&
                               ain.size(0) == T), "attn_in must be fp32 [T, K0]");
  const int64_t k0 = ain.numel() ? ain.size(1) : Hd;

  // Where the queries look.
  at::Tensor qi_t, qv_t;
  Layout lay{};
  lay.mask = mask.numel() ? mask.data_ptr<bool>() : nullptr;
  if (kv_start >= 0) {  // one sequence, context in consecutive slots
    lay.B = 1;
    lay.N = T;
    lay.L = kv_end - kv_start;
    lay.first = kv_start;
    TORCH_CHECK(!lay.mask || mask.numel() == T * lay.L, "mask must be [1, 1, T, L]");
  } else {
    qi_t = query_index.contiguous();
    qv_t = query_valid.contiguous();
    lay.B = kv_slots.size(0);
    lay.L = kv_slots.size(1);
    lay.N = query_index.size(1);
    TORCH_CHECK(kv_slots.is_contiguous() && kv_slots.scalar_type() == at::kLong, "bad kv_slots");
    TORCH_CHECK(mask.numel() == lay.B * lay.N * lay.L, "paged attention needs the [B,1,N,L] mask");
    lay.slots = kv_slots.data_ptr<int64_t>();
    lay.qidx = qi_t.data_ptr<int64_t>();
    lay.qvalid = qv_t.data_ptr<bool>();
  }
  bool any_dense = false;
  for (int64_t b = 0; b < lay.B; ++b) any_dense = any_dense || lay.count(b) > kDenseQueries;

  // Buffers for the whole call.
  const auto f32 = h.options().dtype(at::kFloat);
  at::Tensor residual = h.contiguous().clone();
  at::Tensor xn = at::empty({T, Hd}, f32), mlp = at::empty({T, Hd}, f32);
  at::Tensor qkv = at::empty({T, W}, f32), attn = at::empty({T, qs}, f32);
  at::Tensor gu = at::empty({T, 2 * I}, f32), act = at::empty({T, I}, f32);
  float* res = residual.data_ptr<float>();
  float* xp = xn.data_ptr<float>();
  float* mp = mlp.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();
  float* ap = attn.data_ptr<float>();
  float* gup = gu.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  const int64_t* slots = slot_map.data_ptr<int64_t>();

  std::vector<at::Tensor> out(1);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[l * kPerLayer];
    // For l > 0 the previous MLP output is added to the residual first (fused).
    const bool given = l == 0 && ain.numel();
    if (l == 0 && !given)
      rmsnorm_rows(res, Hd, nullptr, fptr(w[0]), xp, Hd, T, Hd, d.eps);
    else if (l > 0)
      rmsnorm_rows(mp, Hd, res, fptr(w[0]), xp, Hd, T, Hd, d.eps);
    for (auto c : capture)
      if (c == l) out.push_back(residual.clone());  // the residual stream entering layer l
    if (given)
      linear_rows(fptr(ain), k0, T, w[1], W, k0, fptr(w[2]), qkvp, W, d.bf16_activations);
    else
      linear_rows(xp, Hd, T, w[1], W, Hd, fptr(w[2]), qkvp, W, d.bf16_activations);
    float* qp = qkvp;
    float* kp = qkvp + qs;
    float* vp = qkvp + qs + kvs;
    if (w[7].numel()) {  // Qwen3: RMSNorm per head on q and k (in place)
      for (int64_t t = 0; t < T; ++t) {
        rmsnorm_rows(qp + t * W, D, nullptr, fptr(w[7]), qp + t * W, D, d.heads, D, d.eps);
        rmsnorm_rows(kp + t * W, D, nullptr, fptr(w[8]), kp + t * W, D, d.kv_heads, D, d.eps);
      }
    }
    rope_rows(qp, T, d.heads, D, W, D, fptr(cos_c), fptr(sin_c));
    rope_rows(kp, T, d.kv_heads, D, W, D, fptr(cos_c), fptr(sin_c));
    // Keys and values into their cache slots.
    const at::Tensor kl = kv.select(0, l);
    CacheView cv{kl.select(0, 0).data_ptr<float>(), kl.select(0, 1).data_ptr<float>(),
                 kv.stride(2), kv.stride(3)};
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hk = 0; hk < d.kv_heads; ++hk) {
        std::memcpy(cv.k + hk * cv.head_stride + slots[t] * cv.slot_stride,
                    kp + t * W + hk * D, D * 4);
        std::memcpy(cv.v + hk * cv.head_stride + slots[t] * cv.slot_stride,
                    vp + t * W + hk * D, D * 4);
      }
    direct_attention(qp, W, d.heads, D, cv, d.kv_heads, lay, ap);
    if (any_dense) {
      const at::Tensor q = qkv.narrow(1, 0, qs).view({T, d.heads, D});
      dense_attention(q, kl.select(0, 0), kl.select(0, 1), lay, mask, attn);
    }
    linear_rows(ap, qs, T, w[3], Hd, qs, nullptr, mp, Hd, d.bf16_activations);
    rmsnorm_rows(mp, Hd, res, fptr(w[4]), xp, Hd, T, Hd, d.eps);  // residual += o
    linear_rows(xp, Hd, T, w[5], 2 * I, Hd, nullptr, gup, 2 * I, d.bf16_activations);
    silu_mul_rows(gup, actp, T, I);
    linear_rows(actp, I, T, w[6], Hd, I, nullptr, mp, Hd, d.bf16_activations);
  }
  at::Tensor final_h = at::empty({T, Hd}, f32);
  rmsnorm_rows(mp, Hd, res, fptr(weights.back()), final_h.data_ptr<float>(), Hd, T, Hd, d.eps);
  for (auto c : capture)
    if (c == layers) out.push_back(residual.clone());  // after the last layer, before the norm
  out[0] = final_h;
  return out;
}

}  // namespace specdecode
