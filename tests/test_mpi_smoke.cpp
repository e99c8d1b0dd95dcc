// The MPI test harness itself (tests/mpi_catch_main.cpp, kvattn_add_mpi_test): MPI is
// initialized on every rank before the test cases run, every rank sees the same world,
// and a collective reaches every rank (run as test_mpi_smoke.np1 to .np4).
#include <mpi.h>
#include <catch2/catch.hpp>

TEST_CASE("MPI is initialized by the test main", "[mpi]") {
  int initialized = 0;
  int finalized = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  CHECK(initialized != 0);
  CHECK(finalized == 0);
}

TEST_CASE("every rank sees the same world", "[mpi]") {
  int size = 0;
  int rank = -1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  CHECK(size >= 1);
  CHECK(rank >= 0);
  CHECK(rank < size);

  int smallest = 0;
  int largest = 0;
  MPI_Allreduce(&size, &smallest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&size, &largest, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  CHECK(smallest == size);
  CHECK(largest == size);
}

TEST_CASE("an allreduce sums the ranks", "[mpi]") {
  int size = 0;
  int rank = -1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  long sum = -1;
  const long mine = rank;
  MPI_Allreduce(&mine, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum == static_cast<long>(size) * (size - 1) / 2);
}
