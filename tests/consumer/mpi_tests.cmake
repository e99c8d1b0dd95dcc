# CTest tests for the optional component mpi (tests/consumer/mpi/), next to
# consumer_tests.cmake's (whose _consumer_options, _consumer_prefix and kvattn_installed
# fixture this reuses); only when kvattn::mpi exists (KVATTN_WITH_MPI):
#   consumer.mpi.find_package        find_package(kvattn COMPONENTS mpi), kvattn::mpi
#   consumer.mpi.add_subdirectory    kvattn::mpi through add_subdirectory
#   consumer.no_mpi.find_package     MPI hidden: plain kvattn::kvattn works,
#   consumer.no_mpi.add_subdirectory   and kvattn::mpi is absent
# The program runs as a one-rank MPI singleton (no mpiexec).
if(NOT KVATTN_WITH_MPI)
  return()
endif()
set(_mpi_source "${CMAKE_CURRENT_SOURCE_DIR}/consumer/mpi")
set(_mpi_hidden -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DKVATTN_CONSUMER_MPI=OFF)
set(_mpi_common
  --build-generator "${CMAKE_GENERATOR}"
  --build-makeprogram "${CMAKE_MAKE_PROGRAM}"
  --build-project kvattn_mpi_consumer
  --build-config Debug)
if(CMAKE_GENERATOR_PLATFORM)
  list(APPEND _mpi_common --build-generator-platform "${CMAKE_GENERATOR_PLATFORM}")
endif()
# As for the mpi-labelled tests: Open MPI as root, and without CMA in containers.
set(_mpi_environment OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
                     OMPI_MCA_btl_vader_single_copy_mechanism=none)

foreach(_variant mpi no_mpi)
  set(_extra "")
  if(_variant STREQUAL "no_mpi")
    set(_extra ${_mpi_hidden})
  endif()
  if(KVATTN_INSTALL)
    add_test(NAME consumer.${_variant}.find_package
      COMMAND "${CMAKE_CTEST_COMMAND}" --build-and-test "${_mpi_source}"
              "${CMAKE_CURRENT_BINARY_DIR}/consumer-${_variant}-package" ${_mpi_common}
              --build-options ${_consumer_options} ${_extra} -DKVATTN_CONSUMER_MODE=package
                              "-DCMAKE_PREFIX_PATH=${_consumer_prefix}"
                              "-DKVATTN_EXPECTED_PREFIX=${_consumer_prefix}"
              --test-command mpi_consumer)
    set_tests_properties(consumer.${_variant}.find_package PROPERTIES
      FIXTURES_REQUIRED kvattn_installed LABELS consumer ENVIRONMENT "${_mpi_environment}")
  endif()
  add_test(NAME consumer.${_variant}.add_subdirectory
    COMMAND "${CMAKE_CTEST_COMMAND}" --build-and-test "${_mpi_source}"
            "${CMAKE_CURRENT_BINARY_DIR}/consumer-${_variant}-subdirectory" ${_mpi_common}
            --build-options ${_consumer_options} ${_extra} -DKVATTN_CONSUMER_MODE=subdirectory
                            "-DKVATTN_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
            --test-command mpi_consumer)
  set_tests_properties(consumer.${_variant}.add_subdirectory PROPERTIES
    LABELS consumer ENVIRONMENT "${_mpi_environment}")
endforeach()
