// Catch2's main for the MPI tests (kvattn_add_mpi_test in tests/CMakeLists.txt), in an
// object library of its own. A test file therefore never calls MPI_Init or
// MPI_Finalize: MPI is initialized before the first test case runs and finalized after
// the last, on every rank.
//
// Every rank runs the whole Catch session; the exit code is the worst over all ranks
// (MPI_Allreduce MAX), so every rank, and hence mpiexec, exits with the same code. Rank 0
// prints Catch's report; every other rank keeps its report in memory and prints it only
// when a test failed on that rank, after rank 0's, one rank at a time.
//
// Every rank must reach the same collectives in the same order: an assertion that stops
// a test case on one rank (REQUIRE) before a collective the others enter leaves them
// waiting, until CTest's TIMEOUT. Prefer CHECK before collectives, or make the
// condition collective first.
#define CATCH_CONFIG_RUNNER
#define CATCH_CONFIG_NOSTDOUT  // Catch writes through Catch::cout() etc., defined below
#include <mpi.h>
#include <catch2/catch.hpp>

#include <iostream>
#include <sstream>
#include <string>

namespace {

int world_rank = 0;

// The report of a rank other than 0.
std::ostringstream& buffered_report() {
  static std::ostringstream report;
  return report;
}

}  // namespace

namespace Catch {
std::ostream& cout() { return world_rank == 0 ? std::cout : buffered_report(); }
std::ostream& cerr() { return world_rank == 0 ? std::cerr : buffered_report(); }
std::ostream& clog() { return world_rank == 0 ? std::clog : buffered_report(); }
}  // namespace Catch

int main(int argc, char* argv[]) {
  MPI_Init(&argc, &argv);
  int world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);

  // Catch's result: the number of failed assertions (at most 255), 0 when all passed.
  Catch::Session session;
  // mpiexec forwards output through a pseudo-terminal, which Catch would colour; logs
  // stay plain unless --use-colour yes asks otherwise.
  session.configData().useColour = Catch::UseColour::No;
  const int result = session.run(argc, argv);
  std::cout << std::flush;

  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  const int failed_here = result != 0 ? 1 : 0;
  int failed_ranks = 0;
  MPI_Reduce(&failed_here, &failed_ranks, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);

  for (int rank = 1; rank < world_size; ++rank) {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == world_rank && failed_here != 0) {
      std::cout << "==== rank " << world_rank << " of " << world_size << " failed; its report:\n"
                << buffered_report().str() << std::flush;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank == 0 && worst != 0) {
    std::cout << "==== mpi_catch_main: tests failed on " << failed_ranks << " of " << world_size
              << " ranks\n"
              << std::flush;
  }

  MPI_Finalize();
  return worst;
}
