// Self-attention pooling: one bidirectional self-attention layer over a sequence, then
// the mean over the kept tokens (seed 002, Chapter 6: NV-Embed removes the causal mask
// for embedding and pools). The bidirectional layer is the expanded reference under
// Mask::bidirectional(), the one expanded model of each mechanism: pooling is not a
// serving path, and the reference computes every mechanism and rope mode exactly.
// This header therefore includes the references, and the umbrella kvattn.hpp leaves
// it out, as it does them.
#pragma once

#include "kvattn/core/mask.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/pooling/simple_pooling.hpp"
#include "kvattn/pooling/token_mask.hpp"
#include "kvattn/reference/gqa.hpp"
#include "kvattn/reference/lrkv.hpp"
#include "kvattn/reference/mla.hpp"

namespace kvattn {

/// Bidirectional self-attention of `layer` over x (L x d, L >= 1), then the mean over
/// the tokens `mask` keeps (masked tokens still shape the others through attention;
/// they are only left out of the mean). Returns 1 x d. Throws shape_error for a wrong
/// width or mask length, pooling_error when nothing is left to pool.
template <class Layer>
RowVector<typename Layer::scalar_type> self_attention_pool(
    const Layer& layer, const ConstMatrixRef<typename Layer::scalar_type>& x,
    const TokenMask& mask = {}) {
  using T = typename Layer::scalar_type;
  detail::check_pool_input("self_attention_pool", x, layer.config().d_model, mask);
  const RowMatrix<T> encoded = reference::forward(layer, x, Mask::bidirectional());
  return mean_pool<T>(encoded, mask);
}

}  // namespace kvattn
