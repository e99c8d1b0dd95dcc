# CTest tests for the optional component hf_config (tests/consumer/hf_config/), next to
# consumer_tests.cmake's (whose _consumer_options, _consumer_prefix and kvattn_installed
# fixture this reuses):
#   consumer.hf_config.find_package       find_package(kvattn COMPONENTS hf_config)
#   consumer.hf_config.add_subdirectory   kvattn::hf_config through add_subdirectory
#   consumer.no_nlohmann.find_package     nlohmann_json hidden: plain kvattn::kvattn
#   consumer.no_nlohmann.add_subdirectory   works, and kvattn::hf_config is absent
set(_hf_source "${CMAKE_CURRENT_SOURCE_DIR}/consumer/hf_config")
set(_hf_hidden -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON -DKVATTN_CONSUMER_HF=OFF)
set(_hf_common
  --build-generator "${CMAKE_GENERATOR}"
  --build-makeprogram "${CMAKE_MAKE_PROGRAM}"
  --build-project kvattn_hf_consumer
  --build-config Debug)
if(CMAKE_GENERATOR_PLATFORM)
  list(APPEND _hf_common --build-generator-platform "${CMAKE_GENERATOR_PLATFORM}")
endif()

foreach(_variant hf_config no_nlohmann)
  set(_extra "")
  if(_variant STREQUAL "no_nlohmann")
    set(_extra ${_hf_hidden})
  endif()
  if(KVATTN_INSTALL)
    add_test(NAME consumer.${_variant}.find_package
      COMMAND "${CMAKE_CTEST_COMMAND}" --build-and-test "${_hf_source}"
              "${CMAKE_CURRENT_BINARY_DIR}/consumer-${_variant}-package" ${_hf_common}
              --build-options ${_consumer_options} ${_extra} -DKVATTN_CONSUMER_MODE=package
                              "-DCMAKE_PREFIX_PATH=${_consumer_prefix}"
                              "-DKVATTN_EXPECTED_PREFIX=${_consumer_prefix}"
              --test-command hf_consumer)
    set_tests_properties(consumer.${_variant}.find_package PROPERTIES
      FIXTURES_REQUIRED kvattn_installed LABELS consumer)
  endif()
  add_test(NAME consumer.${_variant}.add_subdirectory
    COMMAND "${CMAKE_CTEST_COMMAND}" --build-and-test "${_hf_source}"
            "${CMAKE_CURRENT_BINARY_DIR}/consumer-${_variant}-subdirectory" ${_hf_common}
            --build-options ${_consumer_options} ${_extra} -DKVATTN_CONSUMER_MODE=subdirectory
                            "-DKVATTN_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
            --test-command hf_consumer)
  set_tests_properties(consumer.${_variant}.add_subdirectory PROPERTIES LABELS consumer)
endforeach()
