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
    bool bf16_activations, const std::vector<int64_t>& capture);

}  // namespace specdecode
