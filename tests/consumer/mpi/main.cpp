// A user's program: with kvattn::mpi it includes kvattn's MPI header, starts MPI (run
// directly, as a one-rank singleton) and decodes through both kinds of parallel layer, so
// that their templates compile under the consumer's own flags; without it, plain
// kvattn::kvattn.
#include <cstdio>

#include <kvattn/version.hpp>
#if KVATTN_CONSUMER_MPI
#include <kvattn/distributed/mpi.hpp>
#include <kvattn/kvattn.hpp>
#endif

int main(int argc, char* argv[]) {
  int ranks = 1;
#if KVATTN_CONSUMER_MPI
  MPI_Init(&argc, &argv);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  bool finite = true;
  {
    const auto layer = kvattn::GqaLayer<float>::random(kvattn::gqa_config(16, 4, 4, 2), 1);
    const kvattn::RowMatrix<float> x = kvattn::RowMatrix<float>::Ones(3, 16);
    kvattn::mpi::ContextParallel<kvattn::GqaLayer<float>> by_tokens(layer, MPI_COMM_WORLD, 8);
    kvattn::mpi::HeadParallel<kvattn::GqaLayer<float>> by_heads(layer, MPI_COMM_WORLD);
    finite = by_tokens.prefill(x.topRows(2)).allFinite() &&
             by_tokens.decode(x.row(2)).allFinite() && by_heads.prefill(x).allFinite();
  }
  MPI_Finalize();
  if (!finite) return 1;
#else
  (void)argc;
  (void)argv;
#endif
  std::printf("kvattn %d.%d.%d on %d rank(s)\n", KVATTN_VERSION_MAJOR, KVATTN_VERSION_MINOR,
              KVATTN_VERSION_PATCH, ranks);
  return ranks >= 1 ? 0 : 1;
}
