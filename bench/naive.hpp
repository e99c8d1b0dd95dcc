// The decode_naive baselines: the attention step a competent Eigen user would write over
// the same cache buffers kvattn reads, in the two obvious forms, so that every decode
// benchmark can say how it compares (the vs_naive counter):
//
//   per_head  for each query head: scores = K q_h (a GEMV over the head's dense key
//             block), softmax, o_h = V^T a (a transposed GEMV); threads over heads.
//   per_group for each KV group (MLA, LRKV: one group of every head): S = Q_g K^T (one
//             GEMM of the group's query rows against the block), row softmax, O = P V;
//             threads over the group's query rows (MHA: over groups).
//
// MLA uses the absorbed math in both forms (q~_h = scale q_h^nope W_UK_h^T over the
// latent rows [c | k_R], o_h = (a C) W_UV_h); LRKV the associative one (logits from the
// shared key plus each head's residual slice, o_h = a V_s + (a R_h^V) B_h^V^T). Queries
// are rotated and scaled as the layer does. Everything is plain Eigen (serial products:
// kvattn builds with EIGEN_DONT_PARALLELIZE) and OpenMP over heads; the per-thread
// buffers are allocated before the timed steps, Eigen's GEMM blocking is left as Eigen
// does it.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include <kvattn/attention/gqa.hpp>
#include <kvattn/attention/lrkv.hpp>
#include <kvattn/attention/mla.hpp>

#include "bench_util.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvb {

enum class NaiveForm { per_head, per_group };

inline const char* to_string(NaiveForm f) {
  return f == NaiveForm::per_head ? "per_head" : "per_group";
}

/// f(i) for i < n over `threads` OpenMP threads (static schedule), with the thread index.
template <class F>
void naive_parallel(Index n, int threads, F&& f) {
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (Index i = 0; i < n; ++i) f(i, omp_get_thread_num());
    return;
  }
#endif
  (void)threads;
  for (Index i = 0; i < n; ++i) f(i, 0);
}

using ConstRows = Eigen::Map<const Mat, Eigen::Unaligned, Eigen::OuterStride<>>;
using Rows = Eigen::Map<Mat, Eigen::Unaligned, Eigen::OuterStride<>>;

/// Softmax of each row of s in place (max-shifted), returning nothing: the rows sum to 1.
template <class Derived>
void softmax_rows(Eigen::MatrixBase<Derived>& s) {
  for (Index i = 0; i < s.rows(); ++i) {
    auto row = s.row(i).array();
    const float max = row.maxCoeff();
    row = (row - max).exp();
    row /= row.sum();
  }
}

// ---- MHA / GQA / MQA -------------------------------------------------------------------

/// Over a float GqaCache: K_g and V_g are the cache's dense tokens x d_h blocks.
struct NaiveGqa {
  using Layer = kvattn::GqaLayer<float>;
  using Cache = kvattn::GqaCache<float, float>;

  const Layer* layer = nullptr;
  int threads = 1;
  Row query;                 // 1 x H d_h: rotated and scaled
  std::vector<Mat> scratch;  // per thread: per_head 1 x L, per_group G x L

  void prepare(const Layer& l, Index L, int t) {
    layer = &l;
    threads = t;
    const auto& c = l.config();
    query.resize(c.n_heads * c.head_dim);
    scratch.assign(static_cast<std::size_t>(std::max(t, 1)), Mat(c.group_size(), L));
  }

  void run(NaiveForm form, const Cache& cache, const Row& q, Row& heads) {
    const auto& c = layer->config();
    const Index L = cache.tokens(), dh = c.head_dim, G = c.group_size();
    query = q;
    layer->rope().rotate(query.data(), static_cast<double>(c.rope.position_offset + L - 1),
                         c.n_heads, dh);
    query *= layer->softmax_scale();
    auto block = [&](const float* p) { return ConstRows(p, L, dh, Eigen::OuterStride<>(dh)); };
    if (form == NaiveForm::per_head) {
      naive_parallel(c.n_heads, threads, [&](Index h, int thread) {
        const Index g = h / G;
        const auto K = block(cache.key_row(g, 0));
        const auto V = block(cache.value_row(g, 0));
        auto s = scratch[static_cast<std::size_t>(thread)].row(0);
        s.noalias() = (K * query.segment(h * dh, dh).transpose()).transpose();
        softmax_rows(s);
        heads.segment(h * dh, dh).noalias() = s * V;
      });
    } else {
      naive_parallel(c.n_kv_heads, threads, [&](Index g, int thread) {
        const auto K = block(cache.key_row(g, 0));
        const auto V = block(cache.value_row(g, 0));
        const ConstRows Q(query.data() + g * G * dh, G, dh, Eigen::OuterStride<>(dh));
        Mat& S = scratch[static_cast<std::size_t>(thread)];
        S.noalias() = Q * K.transpose();
        softmax_rows(S);
        Rows(heads.data() + g * G * dh, G, dh, Eigen::OuterStride<>(dh)).noalias() = S * V;
      });
    }
  }
};

// ---- MLA (absorbed) ------------------------------------------------------------------------

struct NaiveMla {
  using Layer = kvattn::MlaLayer<float>;
  using Cache = kvattn::MlaCache<float, float>;

  const Layer* layer = nullptr;
  int threads = 1;
  Row query;                 // 1 x H (d_nope + d_R): rope part rotated
  Mat absorbed;              // H x (d_c + d_R): scale [q_h^nope W_UK_h^T | q_h^R]
  Mat latent_heads;          // H x d_c
  std::vector<Mat> scratch;  // per thread: per_head 1 x L, per_group (H / threads) x L

  void prepare(const Layer& l, Index L, int t) {
    layer = &l;
    threads = t;
    const auto& c = l.config();
    query.resize(c.query_width());
    absorbed.resize(c.n_heads, c.cache_elements_per_token());
    latent_heads.resize(c.n_heads, c.kv_rank);
    const Index rows = (c.n_heads + t - 1) / std::max(t, 1);
    scratch.assign(static_cast<std::size_t>(std::max(t, 1)), Mat(rows, L));
  }

  void run(NaiveForm form, const Cache& cache, const Row& q, Row& heads) {
    const auto& c = layer->config();
    const auto& w = layer->weights();
    const Index L = cache.tokens(), dc = c.kv_rank, dn = c.qk_nope_dim, dr = c.rope_dim;
    const Index qd = c.qk_head_dim(), width = c.cache_elements_per_token(), H = c.n_heads;
    const float scale = layer->softmax_scale();
    query = q;
    layer->rope().rotate(query.data() + dn, static_cast<double>(c.rope.position_offset + L - 1), H,
                         qd);
    const ConstRows rows(cache.row_data(0), L, width, Eigen::OuterStride<>(width));
    const auto latent = rows.leftCols(dc);
    naive_parallel(H, threads, [&](Index h, int) {
      absorbed.row(h).head(dc).noalias() =
          scale * query.segment(h * qd, dn) * w.w_uk.middleCols(h * dn, dn).transpose();
      absorbed.row(h).tail(dr) = scale * query.segment(h * qd + dn, dr);
    });
    if (form == NaiveForm::per_head) {
      naive_parallel(H, threads, [&](Index h, int thread) {
        auto s = scratch[static_cast<std::size_t>(thread)].row(0);
        s.noalias() = (rows * absorbed.row(h).transpose()).transpose();
        softmax_rows(s);
        latent_heads.row(h).noalias() = s * latent;
      });
    } else {
      const int parts = std::max(1, std::min<int>(threads, static_cast<int>(H)));
      const Index per = (H + parts - 1) / parts;
      naive_parallel(parts, threads, [&](Index part, int thread) {
        const Index h0 = part * per, n = std::min(per, H - h0);
        if (n <= 0) return;
        auto S = scratch[static_cast<std::size_t>(thread)].topRows(n);
        S.noalias() = absorbed.middleRows(h0, n) * rows.transpose();
        softmax_rows(S);
        latent_heads.middleRows(h0, n).noalias() = S * latent;
      });
    }
    naive_parallel(H, threads, [&](Index h, int) {
      heads.segment(h * c.v_dim, c.v_dim).noalias() =
          latent_heads.row(h) * w.w_uv.middleCols(h * c.v_dim, c.v_dim);
    });
  }
};

// ---- LRKV (associative) ---------------------------------------------------------------------

/// rope_mode shared or none, no key norm, no decoupled part (the benchmark's shape);
/// NaiveLrkv::supports says so.
struct NaiveLrkv {
  using Layer = kvattn::LrkvLayer<float>;
  using Cache = kvattn::LrkvCache<float, float>;

  const Layer* layer = nullptr;
  int threads = 1;
  Row query;                 // 1 x H d_h   rotated (shared mode), scaled
  Row latent_query;          // 1 x H r     (q_h (.) g) B_h^K, scaled (unrotated q_h)
  Mat acc;                   // H x (d_h + r)
  std::vector<Mat> scratch;  // per thread: per_head 1 x L, per_group (H / threads) x L

  static bool supports(const kvattn::LrkvConfig& c) {
    return !c.key_norm && c.decoupled_dim() == 0 &&
           (c.rope_mode == kvattn::LrkvRopeMode::shared ||
            c.rope_mode == kvattn::LrkvRopeMode::none);
  }

  void prepare(const Layer& l, Index L, int t) {
    layer = &l;
    threads = t;
    const auto& c = l.config();
    query.resize(c.n_heads * c.head_dim);
    latent_query.resize(c.n_heads * c.rank);
    acc.resize(c.n_heads, c.head_dim + c.rank);
    const Index rows = (c.n_heads + t - 1) / std::max(t, 1);
    scratch.assign(static_cast<std::size_t>(std::max(t, 1)), Mat(rows, L));
  }

  void run(NaiveForm form, const Cache& cache, const Row& q, Row& heads) {
    const auto& c = layer->config();
    const auto& w = layer->weights();
    const Index L = cache.tokens(), dh = c.head_dim, r = c.rank, H = c.n_heads;
    const Index kw = dh + H * r, vw = dh + H * r;  // no decoupled part (supports())
    const float scale = layer->softmax_scale();
    for (Index h = 0; h < H; ++h) {
      latent_query.segment(h * r, r).noalias() =
          scale * q.segment(h * dh, dh) * w.basis_k.middleCols(h * r, r);
    }
    query = q * scale;
    if (c.rope_mode == kvattn::LrkvRopeMode::shared) {
      layer->rope().rotate(query.data(), static_cast<double>(c.rope.position_offset + L - 1), H,
                           dh);
    }
    const ConstRows keys(cache.key_row(0), L, kw, Eigen::OuterStride<>(kw));
    const ConstRows values(cache.value_row(0), L, vw, Eigen::OuterStride<>(vw));
    const auto shared_keys = keys.leftCols(dh);
    const auto shared_values = values.leftCols(dh);
    if (form == NaiveForm::per_head) {
      naive_parallel(H, threads, [&](Index h, int thread) {
        auto s = scratch[static_cast<std::size_t>(thread)].row(0);
        s.noalias() = (shared_keys * query.segment(h * dh, dh).transpose()).transpose();
        s.noalias() += (keys.middleCols(dh + h * r, r) * latent_query.segment(h * r, r).transpose())
                           .transpose();
        softmax_rows(s);
        acc.row(h).head(dh).noalias() = s * shared_values;
        acc.row(h).tail(r).noalias() = s * values.middleCols(dh + h * r, r);
      });
    } else {
      const int parts = std::max(1, std::min<int>(threads, static_cast<int>(H)));
      const Index per = (H + parts - 1) / parts;
      naive_parallel(parts, threads, [&](Index part, int thread) {
        const Index h0 = part * per, n = std::min(per, H - h0);
        if (n <= 0) return;
        auto S = scratch[static_cast<std::size_t>(thread)].topRows(n);
        const ConstRows Q(query.data() + h0 * dh, n, dh, Eigen::OuterStride<>(dh));
        S.noalias() = Q * shared_keys.transpose();
        for (Index h = h0; h < h0 + n; ++h) {
          S.row(h - h0).noalias() +=
              (keys.middleCols(dh + h * r, r) * latent_query.segment(h * r, r).transpose())
                  .transpose();
        }
        softmax_rows(S);
        acc.middleRows(h0, n).leftCols(dh).noalias() = S * shared_values;
        for (Index h = h0; h < h0 + n; ++h) {
          acc.row(h).tail(r).noalias() = S.row(h - h0) * values.middleCols(dh + h * r, r);
        }
      });
    }
    naive_parallel(H, threads, [&](Index h, int) {
      auto out = heads.segment(h * dh, dh);
      out = acc.row(h).head(dh);
      out.noalias() += acc.row(h).tail(r) * w.basis_v.middleCols(h * r, r).transpose();
    });
  }
};

}  // namespace kvb
