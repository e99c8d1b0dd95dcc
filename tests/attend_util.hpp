// Helpers shared by the tests of the attention step (attend) and its reference:
// the widths of attend's arguments, the projected query in double, the layer in double.
#pragma once

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "kvattn/core/rms_norm.hpp"

namespace kvattn::test {

// Widths of attend's query and heads arguments (docs/api.md, "The layer contract",
// "The attention step").
inline Index query_width(const GqaConfig& c) { return c.n_heads * c.head_dim; }
inline Index query_width(const MlaConfig& c) { return c.query_width(); }
inline Index query_width(const LrkvConfig& c) { return c.query_width(); }
inline Index heads_width(const GqaConfig& c) { return c.n_heads * c.head_dim; }
inline Index heads_width(const MlaConfig& c) { return c.n_heads * c.v_dim; }
inline Index heads_width(const LrkvConfig& c) { return c.n_heads * c.head_dim; }

// The projected query of x (1 x d, before RoPE), computed in double, in attend's layout.
inline RowMatrix<double> project_query(const GqaLayer<double>& layer, const RowMatrix<double>& x) {
  RowMatrix<double> q = x * layer.weights().w_q;
  if (layer.config().qkv_bias) q += layer.weights().bias_q;
  return q;
}
inline RowMatrix<double> project_query(const MlaLayer<double>& layer, const RowMatrix<double>& x) {
  const MlaConfig& c = layer.config();
  const MlaWeights<double>& w = layer.weights();
  if (c.q_rank == 0) return x * w.w_q;
  RowMatrix<double> c_q = x * w.w_dq;
  if (c.q_norm) rms_norm_inplace(c_q.data(), c.q_rank, w.q_norm_gain.data(), c.norm_epsilon);
  return c_q * w.w_uq;
}
inline RowMatrix<double> project_query(const LrkvLayer<double>& layer, const RowMatrix<double>& x) {
  const LrkvConfig& c = layer.config();
  // Head h's [x W_Q_h | x W_QR_h] in columns [h*(d_h+d_R), (h+1)*(d_h+d_R)).
  const Index dh = c.head_dim, dr = c.decoupled_dim();
  const RowMatrix<double> content = x * layer.weights().w_q;
  const RowMatrix<double> rope = x * layer.weights().w_qr;
  RowMatrix<double> q(1, query_width(c));
  for (Index h = 0; h < c.n_heads; ++h) {
    q.middleCols(h * (dh + dr), dh) = content.middleCols(h * dh, dh);
    q.middleCols(h * (dh + dr) + dh, dr) = rope.middleCols(h * dr, dr);
  }
  return q;
}

// The same layer computing in double (weights widened exactly).
inline GqaLayer<double> to_double(const GqaLayer<float>& layer) {
  return {layer.config(), layer.weights().template cast<double>()};
}
inline MlaLayer<double> to_double(const MlaLayer<float>& layer) {
  return {layer.config(), layer.weights().template cast<double>()};
}
inline LrkvLayer<double> to_double(const LrkvLayer<float>& layer) {
  return {layer.config(), layer.weights().template cast<double>()};
}

}  // namespace kvattn::test
