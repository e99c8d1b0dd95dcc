// Benchmarks of MLA at DeepSeek-V2-Lite's shape (mla) and DeepSeek-V2's (mla_v2):
// decode_naive, decode (absorbed attend), decode_bf16, layer_decode, decode_expanded (the
// re-projecting reference step) and decode_precached/mla, the baseline the absorbed
// path must beat: a cache of already up-projected per-head keys and values decoded
// like MHA, by the kernel below.
#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "bench_drivers.hpp"
#include "mech_mla.hpp"

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace kvb {
namespace {

/// A float buffer aligned to 2 MiB and, on Linux, advised onto transparent huge
/// pages, as large kvattn caches are.
class HugeBuffer {
 public:
  explicit HugeBuffer(std::size_t count) : count_(count) {
    constexpr std::size_t align = std::size_t{2} << 20;
    const std::size_t bytes = (count * sizeof(float) + align - 1) / align * align;
    data_.reset(static_cast<float*>(std::aligned_alloc(align, bytes)));
    if (!data_) throw std::bad_alloc();
#ifdef __linux__
    madvise(data_.get(), bytes, MADV_HUGEPAGE);
#endif
  }
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  std::size_t size() const { return count_; }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  std::size_t count_;
};

/// What MLA would cache without absorption: per head h and token t the up-projected
/// key [c_t W_UK_h | k_R,t] (d_nope + d_R = 192) and value c_t W_UV_h (d_v = 128),
/// 16 * 320 = 5120 elements per token at the V2-Lite shape (8.9x the latent row).
/// Head-major: head h's keys are one dense tokens x 192 block, its values one
/// tokens x 128 block.
struct PrecachedCache {
  Index heads, key_width, value_width, tokens;
  HugeBuffer keys, values;

  PrecachedCache(Index h, Index kw, Index vw, Index l)
      : heads(h),
        key_width(kw),
        value_width(vw),
        tokens(l),
        keys(static_cast<std::size_t>(h * l * kw)),
        values(static_cast<std::size_t>(h * l * vw)) {}
  const float* key_block(Index h) const { return keys.data() + h * tokens * key_width; }
  const float* value_block(Index h) const { return values.data() + h * tokens * value_width; }
  double bytes() const { return static_cast<double>(keys.size() + values.size()) * sizeof(float); }
};

/// Up-projects the pool's latent rows through W_UK / W_UV and fills L tokens with them
/// cyclically (token t holds pool row t mod rows, as MlaMech::fill does).
std::unique_ptr<PrecachedCache> make_precached(const kvattn::MlaLayer<float>& layer,
                                               const MlaMech::Pool& pool, Index L) {
  const auto& c = layer.config();
  const auto& w = layer.weights();
  const Index dn = c.qk_nope_dim, dr = c.rope_dim, dv = c.v_dim, qd = c.qk_head_dim();
  auto cache = std::make_unique<PrecachedCache>(c.n_heads, qd, dv, L);
  const Index rows = pool.latent.rows();
  Mat key(rows, qd), value(rows, dv);
  for (Index h = 0; h < c.n_heads; ++h) {
    key.leftCols(dn).noalias() = pool.latent * w.w_uk.middleCols(h * dn, dn);
    key.rightCols(dr) = pool.rope_keys;
    value.noalias() = pool.latent * w.w_uv.middleCols(h * dv, dv);
    Eigen::Map<Mat> keys(cache->keys.data() + h * L * qd, L, qd);
    Eigen::Map<Mat> values(cache->values.data() + h * L * dv, L, dv);
    for (Index t = 0; t < L; t += rows) {
      const Index n = std::min(rows, L - t);
      keys.middleRows(t, n) = key.topRows(n);
      values.middleRows(t, n) = value.topRows(n);
    }
  }
  return cache;
}

/// The MHA-like decode over the precached keys and values, for the newest token
/// (index tokens - 1), reading each cached element once: per head a pass over K_h
/// (one vectorized dot product per cached key, s_t = k_t . scale q_h), a vectorized
/// softmax over the scores (tokens floats per head, which stay in L2), and a pass over
/// V_h (o_h += p_t v_t, one vectorized axpy per cached value). Heads are spread over the
/// threads. Per-row Eigen dot / axpy streams at the read-only pass's bandwidth here;
/// Eigen's GEMVs (K_h q_h, V_h^T p) measured at only ~0.55 of it on this machine.
/// `query` is the projected query [q_h^nope | q_h^R] per head, before RoPE.
struct PrecachedDecoder {
  Mat scores;  // H x tokens
  Row query;   // H x (d_nope + d_R), rotated and scaled
  Mat acc;     // H x d_v

  void run(const kvattn::MlaLayer<float>& layer, const PrecachedCache& cache, const Row& q,
           Row& heads, int threads) {
    using Vec = Eigen::VectorXf;
    const auto& c = layer.config();
    const Index L = cache.tokens, kw = cache.key_width, vw = cache.value_width;
    if (scores.rows() != cache.heads || scores.cols() != L) scores.resize(cache.heads, L);
    if (acc.rows() != cache.heads || acc.cols() != vw) acc.resize(cache.heads, vw);
    query = q;
    const double position = static_cast<double>(c.rope.position_offset + L - 1);
    for (Index h = 0; h < cache.heads; ++h) {
      layer.rope().rotate(query.data() + h * kw + c.qk_nope_dim, position);
    }
    query *= layer.softmax_scale();
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (Index h = 0; h < cache.heads; ++h) {
      const float* k = cache.key_block(h);
      const float* v = cache.value_block(h);
      const Eigen::Map<const Vec> qh(query.data() + h * kw, kw);
      float* s = scores.row(h).data();
      for (Index t = 0; t < L; ++t) s[t] = Eigen::Map<const Vec>(k + t * kw, kw).dot(qh);
      Eigen::Map<Vec> sv(s, L);
      const float max = sv.maxCoeff();
      sv = (sv.array() - max).exp();
      const float sum = sv.sum();
      Eigen::Map<Vec> o(acc.row(h).data(), vw);
      o.setZero();
      for (Index t = 0; t < L; ++t) o.noalias() += s[t] * Eigen::Map<const Vec>(v + t * vw, vw);
      Eigen::Map<Vec>(heads.data() + h * vw, vw) = o / sum;
    }
    (void)threads;
  }
};

void run_precached(benchmark::State& state, const MlaMech& mech) {
  const Index L = state.range(0);
  const int T = static_cast<int>(state.range(1));
  const auto layer = layer_of(mech);
  const auto& c = mech.config;
  const double bytes = static_cast<double>(L) * static_cast<double>(c.n_heads) *
                       static_cast<double>(c.qk_head_dim() + c.v_dim) * sizeof(float);
  const int n = rotation_count(bytes);
  std::mt19937_64 rng(7);
  const auto pool = mech.make_pool(rng, std::min(L, kPoolRows));
  std::vector<std::unique_ptr<PrecachedCache>> caches;
  std::vector<ReadSet> reads;
  for (int i = 0; i < n; ++i) {
    caches.push_back(make_precached(*layer, pool, L));
    ReadSet set;
    set.add(caches.back()->keys.data(), caches.back()->keys.size() * sizeof(float));
    set.add(caches.back()->values.data(), caches.back()->values.size() * sizeof(float));
    reads.push_back(set);
  }
  const Row query = kvattn::random_normal<float>(1, mech.query_width(), rng);
  Row heads(mech.heads_width());
  PrecachedDecoder decoder;

  if (smoke()) {
    // The same tokens as a latent cache: the precached step must equal MLA's.
    auto latent = layer->make_cache(L);
    mech.fill(latent, L, pool);
    decoder.run(*layer, *caches[0], query, heads, T);
    const Mat want = kvattn::reference::decode_step(*layer, latent, query);
    const double err = relative_error(heads, want);
    if (!(err <= kCheckTolerance)) {
      fail(state, "precached MLA differs from reference::decode_step by " + std::to_string(err));
      return;
    }
  }

  Limits limits;
  Index it = 0;
  for (auto _ : state) {
    decoder.run(*layer, *caches[static_cast<std::size_t>(it % n)], query, heads, T);
    benchmark::DoNotOptimize(heads.data());
    benchmark::ClobberMemory();
    state.PauseTiming();
    limits.read(reads[static_cast<std::size_t>(read_slot(it, n))], T);
    state.ResumeTiming();
    ++it;
  }
  Cost cost;
  cost.bytes = bytes;
  cost.cache_bytes = bytes;
  // Per head and token: q.k at width d_nope + d_R and a * v at width d_v.
  cost.flops = static_cast<double>(L) * static_cast<double>(c.n_heads) * 2.0 *
               static_cast<double>(c.qk_head_dim() + c.v_dim);
  report(state, cost, limits, T);
}

}  // namespace

void register_mla() {
  const std::vector<int> threads = thread_counts();
  const MlaMech lite = mla_mech();
  const MlaMech v2 = mla_v2_mech();
  for (const MlaMech& m : {lite, v2}) {
    add_naive(m, kDecodeLengths, threads);
    add_decode("decode", m, kDecodeLengths, threads);
  }
  add_decode<MlaMech, Eigen::bfloat16>("decode_bf16", lite, {16384, 65536}, threads);
  add_decode<MlaMech, Eigen::bfloat16>("decode_bf16", v2, {16384, 65536}, threads);
  // The same steps with DecodeArithmetic::bf16_dot (where the build has AVX512-BF16; else
  // the same code as decode_bf16/).
  for (MlaMech m : {lite, v2}) {
    m.arithmetic = kvattn::DecodeArithmetic::bf16_dot;
    add_decode<MlaMech, Eigen::bfloat16>("decode_bf16dot", m, {16384, 65536}, threads);
  }
  for (const MlaMech& m : {lite, v2}) {  // after decode_bf16/: vs_bf16 reads its times
    add_decode<MlaMech, kvattn::Int8<128>>("decode_int8", m, {65536}, threads);
    add_decode<MlaMech, kvattn::Fp8E4M3<128>>("decode_fp8", m, {65536}, threads);
  }
  add(
      "decode_precached/mla", [lite](benchmark::State& state) { run_precached(state, lite); },
      kDecodeLengths, threads);
  add_layer_decode(lite, kDecodeLengths, threads);
  add_layer_decode(v2, kDecodeLengths, threads);
  add_expanded(lite, {1024, 4096});
  add_expanded(v2, {1024});
}

}  // namespace kvb
