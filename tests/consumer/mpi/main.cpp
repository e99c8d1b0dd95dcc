// A user's program: with kvattn::mpi it includes kvattn's MPI header and starts and
// stops MPI (run directly, as a one-rank singleton); without it, plain kvattn::kvattn.
#include <cstdio>

#include <kvattn/version.hpp>
#if KVATTN_CONSUMER_MPI
#include <kvattn/distributed/mpi.hpp>
#endif

int main(int argc, char* argv[]) {
  int ranks = 1;
#if KVATTN_CONSUMER_MPI
  MPI_Init(&argc, &argv);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  MPI_Finalize();
#else
  (void)argc;
  (void)argv;
#endif
  std::printf("kvattn %d.%d.%d on %d rank(s)\n", KVATTN_VERSION_MAJOR, KVATTN_VERSION_MINOR,
              KVATTN_VERSION_PATCH, ranks);
  return ranks >= 1 ? 0 : 1;
}
