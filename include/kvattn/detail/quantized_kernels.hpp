// The decode tile kernels over block-quantized rows (core/quantized.hpp): the kernels of
// decode_kernels.hpp run on the codes, widened in registers and unscaled, and each row's
// block scales are folded in per token afterwards, into the logits (score) and into the
// softmax weights (accumulate): a block's scale multiplies one logit or one weight per
// query row and token, not every element, so the pass reads one byte per element and
// does the float kernels' arithmetic.
//
// A row of `width` values holds width codes and ceil(width / B) fp32 scales; block b covers
// columns [b B, min(width, (b + 1) B)). Rows wider than one block take one pass per block
// (the partial logits of the later blocks in `spare`).
#pragma once

#include <algorithm>

#include "kvattn/core/quantized.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/detail/decode_kernels.hpp"

namespace kvattn::detail {

namespace quantized {

// Block b's scale of each of the n rows into scales[0, n).
template <class T, class S>
inline void gather_scales(const storage_element_t<S>* rows, Index stride, Index width, Index b,
                          Index n, T* scales) {
  for (Index t = 0; t < n; ++t) {
    scales[t] = static_cast<T>(StorageTraits<S>::scale(rows + t * stride, width, b));
  }
}

}  // namespace quantized

/// logits[i * ld + t] = q_i . k_t for i < G, t < n, k_t the dequantized row at
/// k + t * k_stride (storage S, `width` values), q_i = q + i * q_stride (width wide).
/// `spare` holds (G + 1) x ld scalars of scratch.
template <class T, class S>
void score_quantized(const T* q, Index q_stride, Index G, const storage_element_t<S>* k,
                     Index k_stride, Index width, Index n, T* logits, Index ld, T* spare,
                     Prefetcher* prefetch = nullptr) {
  using Traits = StorageTraits<S>;
  T* scales = spare + G * ld;
  for (Index b = 0; b * Traits::block < width; ++b) {
    const Index c0 = b * Traits::block;
    const Index w = std::min(Traits::block, width - c0);
    T* partial = b == 0 ? logits : spare;
    score_rows(q + c0, q_stride, G, w, k + c0, k_stride, 0, n, partial, ld, false,
               b == 0 ? prefetch : nullptr);
    quantized::gather_scales<T, S>(k, k_stride, width, b, n, scales);
    for (Index i = 0; i < G; ++i) {
      T* out = logits + i * ld;
      const T* part = partial + i * ld;
      if (b == 0) {
        for (Index t = 0; t < n; ++t) out[t] *= scales[t];
      } else {
        for (Index t = 0; t < n; ++t) out[t] += part[t] * scales[t];
      }
    }
  }
}

/// acc_i += sum_t w[i * ld + t] v_t for i < G, t < n, v_t the dequantized row at
/// v + t * v_stride (storage S, `width` values), acc row i at acc + i * acc_stride (see
/// accumulate_rows for token_block and prefetch). `spare` holds (G + 1) x ld scalars.
template <class T, class S>
void accumulate_quantized(const T* w, Index ld, Index G, const storage_element_t<S>* v,
                          Index v_stride, Index width, Index n, T* acc, Index acc_stride,
                          Index token_block, Prefetcher* prefetch, T* spare) {
  using Traits = StorageTraits<S>;
  T* scales = spare + G * ld;
  for (Index b = 0; b * Traits::block < width; ++b) {
    const Index c0 = b * Traits::block;
    const Index cols = std::min(Traits::block, width - c0);
    quantized::gather_scales<T, S>(v, v_stride, width, b, n, scales);
    for (Index i = 0; i < G; ++i) {
      const T* weights = w + i * ld;
      T* scaled = spare + i * ld;
      for (Index t = 0; t < n; ++t) scaled[t] = weights[t] * scales[t];
    }
    accumulate_rows(spare, ld, G, v + c0, v_stride, 0, cols, n, acc + c0, acc_stride, token_block,
                    b == 0 ? prefetch : nullptr);
  }
}

}  // namespace kvattn::detail
