// Shared declarations of the specdecode CPU kernels (specdecode_kernels.cpp) and the fused
// decoder loop (decoder.cpp), compiled together into one extension by specdecode/kernels.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace specdecode {

// y[..., N] = x[..., K] @ W^T (+ bias), W packed by kernels.pack.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K,
                  const std::optional<at::Tensor>& bias, bool bf16_activations);

// The same on raw fp32 rows, for the decoder loop (no tensor ops per call): y[M, N] (row stride
// ldy) = x[M, K] (row stride ldx) @ W^T + bias, fp32 activations; `bf16_activations` (bf16
// weights, AVX512_BF16 builds) rounds x to bf16 and multiplies with vdpbf16ps.
void linear_rows(const float* x, int64_t ldx, int64_t M, const at::Tensor& w, int64_t N,
                 int64_t K, const float* bias, float* y, int64_t ldy,
                 bool bf16_activations = false);

// out[r, :I] = silu(src[r, :I]) * src[r, I:2I] for `rows` contiguous rows of 2I.
void silu_mul_rows(const float* src, float* dst, int64_t rows, int64_t I);

// RMSNorm of `rows` rows of H (row strides ldx / ldo; out may alias x); with `res`, res += x in
// place first (rows of H, contiguous) and the sum is normalized.
void rmsnorm_rows(const float* x, int64_t ldx, float* res, const float* w, float* out,
                  int64_t ldo, int64_t rows, int64_t H, double eps);

// out[r * ldo] = scale * <q[r][:D], k[:D]> for r < R (each row summed in the same order
// whatever R: rows are only interleaved, for independent FMA chains).
void dot_rows(const float* const* q, int64_t R, const float* k, int64_t D, float scale, float* out,
              int64_t ldo);

// out[:D] = sum_j p[j] * v[j][:D] over j < n in order (p[j] == 0 skipped), held in registers.
void weighted_rows(const float* p, const float* const* v, int64_t n, int64_t D, float* out);

// s[:n] = softmax(s[:n]) in place (fp32, vectorised exp; -inf entries become 0).
void softmax_row(float* s, int64_t n);

// silu(gate_up[..., :I]) * gate_up[..., I:] (fp32).
at::Tensor silu_mul(const at::Tensor& gate_up);

// HF-style RMSNorm (fp32); with `residual`, residual += x in place first and the sum is
// normalized.
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                   const std::optional<at::Tensor>& residual);

std::vector<at::Tensor> forward_layers(
    at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv,
    const at::Tensor& slot_mapping, int64_t kv_start, int64_t kv_end, const at::Tensor& kv_slots,
    const at::Tensor& query_index, const at::Tensor& query_valid, const at::Tensor& mask,
    const std::vector<at::Tensor>& weights, std::vector<int64_t> dims, double eps,
    bool bf16_activations, const std::vector<int64_t>& capture, const at::Tensor& attn_in);

}  // namespace specdecode
