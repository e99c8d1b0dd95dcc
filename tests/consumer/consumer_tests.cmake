# CTest tests that build tests/consumer/ against kvattn the two ways users do:
#   consumer.install         cmake --install into <build>/tests/consumer-prefix
#   consumer.find_package    configure, build and run the consumer with
#                            CMAKE_PREFIX_PATH=<that prefix> (needs consumer.install)
#   consumer.add_subdirectory  configure, build and run it with add_subdirectory(kvattn)
# Everything stays inside the build tree and works offline.
set(_consumer_source "${CMAKE_CURRENT_SOURCE_DIR}/consumer")
set(_consumer_prefix "${CMAKE_CURRENT_BINARY_DIR}/consumer-prefix")

# The consumer is a separate project with the same compiler and generator and its
# own flags. It is built as Debug: it tests packaging, not speed, and a Debug build
# of a translation unit full of Eigen compiles fastest (and keeps Eigen's asserts on).
set(_consumer_common
  --build-generator "${CMAKE_GENERATOR}"
  --build-makeprogram "${CMAKE_MAKE_PROGRAM}"
  --build-project kvattn_consumer
  --build-config Debug)
set(_consumer_options "-DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Debug)
if(CMAKE_GENERATOR_PLATFORM)
  list(APPEND _consumer_common --build-generator-platform "${CMAKE_GENERATOR_PLATFORM}")
endif()

if(KVATTN_INSTALL)
  add_test(NAME consumer.install
    COMMAND "${CMAKE_COMMAND}" -DBUILD_DIR=${PROJECT_BINARY_DIR} -DPREFIX=${_consumer_prefix}
            -DCONFIG=$<CONFIG> -DINCLUDEDIR=${CMAKE_INSTALL_INCLUDEDIR}
            -DCMAKEDIR=${KVATTN_INSTALL_CMAKEDIR} -P "${_consumer_source}/install.cmake")
  set_tests_properties(consumer.install PROPERTIES
    FIXTURES_SETUP kvattn_installed LABELS consumer)

  add_test(NAME consumer.find_package
    COMMAND "${CMAKE_CTEST_COMMAND}" --build-and-test "${_consumer_source}"
            "${CMAKE_CURRENT_BINARY_DIR}/consumer-package" ${_consumer_common}
            --build-options ${_consumer_options} -DKVATTN_CONSUMER_MODE=package
                            "-DCMAKE_PREFIX_PATH=${_consumer_prefix}"
                            "-DKVATTN_EXPECTED_PREFIX=${_consumer_prefix}"
            --test-command consumer)
  set_tests_properties(consumer.find_package PROPERTIES
    FIXTURES_REQUIRED kvattn_installed LABELS consumer)
endif()

add_test(NAME consumer.add_subdirectory
  COMMAND "${CMAKE_CTEST_COMMAND}" --build-and-test "${_consumer_source}"
          "${CMAKE_CURRENT_BINARY_DIR}/consumer-subdirectory" ${_consumer_common}
          --build-options ${_consumer_options} -DKVATTN_CONSUMER_MODE=subdirectory
                          "-DKVATTN_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
          --test-command consumer)
set_tests_properties(consumer.add_subdirectory PROPERTIES LABELS consumer)
