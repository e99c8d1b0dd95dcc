// A user's program: includes the umbrella header, builds a small GQA layer,
// prefills a prompt, decodes a few tokens and checks that every output is finite.
// Built twice: against kvattn::kvattn (`consumer`), which must bring no definitions or
// OpenMP, and against kvattn::openmp (`consumer_openmp`, KVATTN_CONSUMER_OPENMP), whose
// Threads{2} decode must match the one-thread decode.
#include <cstdio>
#include <random>

#include <kvattn/kvattn.hpp>

#if defined(EIGEN_DONT_PARALLELIZE)
#error "kvattn::kvattn must not define EIGEN_DONT_PARALLELIZE for its users"
#endif
#if defined(KVATTN_CONSUMER_OPENMP) != defined(_OPENMP)
#error "OpenMP must come with kvattn::openmp and only with it"
#endif

constexpr bool defined_openmp() {
#if defined(KVATTN_CONSUMER_OPENMP)
  return true;
#else
  return false;
#endif
}

int main() {
  const kvattn::GqaConfig config = kvattn::gqa_config(64, 4, 16, 2);
  const auto layer = kvattn::GqaLayer<float>::random(config, 1);
  auto cache = layer.make_cache();

  std::mt19937_64 rng(2);
  const kvattn::RowMatrix<float> prompt = kvattn::random_normal<float>(8, config.d_model, rng);
  const kvattn::RowMatrix<float> prefilled = layer.prefill(prompt, cache);
  bool finite = prefilled.allFinite();

  kvattn::RowVector<float> out(config.d_model), out_threads(config.d_model);
  auto workspace = layer.make_workspace(kvattn::Threads{2});
  bool threads_agree = true;
  for (int step = 0; step < 4; ++step) {
    const kvattn::RowVector<float> token = kvattn::random_normal<float>(1, config.d_model, rng);
    auto forked = cache;
    layer.decode(token, cache, out, workspace);
    layer.decode(token, forked, out_threads, workspace, kvattn::Threads{2});
    finite = finite && out.allFinite();
    // The same step on two threads (projections split by column, KV groups by thread).
    threads_agree = threads_agree && (out_threads - out).norm() <= 1e-5f * out.norm();
  }
  if (!threads_agree) std::printf("Threads{2} decode differs from the one-thread decode\n");
  if (kvattn::have_openmp != defined_openmp()) std::printf("kvattn::have_openmp is wrong\n");

  std::printf("kvattn %s: %ld tokens cached, %zu bytes, outputs %s\n", kvattn::version,
              static_cast<long>(cache.tokens()), cache.bytes(), finite ? "finite" : "NOT finite");
  const bool ok =
      finite && threads_agree && kvattn::have_openmp == defined_openmp() && cache.tokens() == 12;
  return ok ? 0 : 1;
}
