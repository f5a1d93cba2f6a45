// The kernels' tensor-level entry points, for C++ callers in this extension (decoder_layers.cpp runs a
// step's layers through them without a trip to Python per op). Each is the op registered under the
// same name in the `miniserve` library, with the same checks; the definitions live in gemv.cpp,
// layer_ops.cpp and decode_attention.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace miniserve_ops {

// t's data as T*, T the element type as the kernels see it (float; uint16_t for bf16's bits)
template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, int64_t N,
                int64_t K, int64_t row_block, int64_t k_block, int64_t prefetch_one, int64_t prefetch,
                bool prefetch_l2, int64_t amx_rows, bool prefetch_one_l2, int64_t stream_rows);

at::Tensor gate_up_silu(const at::Tensor& x, const at::Tensor& wp, int64_t inter, int64_t K, int64_t row_block,
                        int64_t k_block, int64_t prefetch_one, int64_t prefetch, bool prefetch_l2, int64_t amx_rows,
                        bool prefetch_one_l2, int64_t stream_rows);

at::Tensor add_rms_norm(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps);

at::Tensor silu_mul(const at::Tensor& gu, int64_t inter);

at::Tensor rotary_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                     int64_t kv_heads, const at::Tensor& k_store, const at::Tensor& v_store, const at::Tensor& slots,
                     const at::Tensor& positions, const std::optional<at::Tensor>& q_norm,
                     const std::optional<at::Tensor>& k_norm, double eps);

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_store, const at::Tensor& v_store,
                            const at::Tensor& slots, const at::Tensor& lens, double scale);

}  // namespace miniserve_ops
