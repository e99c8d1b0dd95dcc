# kvcalc's command-line tests (tests/test_kvcalc.cpp): a Catch2 test that runs the
# built tools/kvcalc/kvcalc as a subprocess on the fixtures in tests/test_kvcalc_data/.
# kvcalc is a tool, so these exist only when tools are built (not in the sanitizer
# preset, which builds no tools; the parser it uses is tested there by test_hf_config
# and the fuzz corpus replays).
if(KVATTN_BUILD_TOOLS)
  kvattn_add_test(test_kvcalc)
  target_link_libraries(test_kvcalc PRIVATE nlohmann_json::nlohmann_json)
  target_compile_definitions(test_kvcalc PRIVATE
    KVCALC_PATH="$<TARGET_FILE:kvcalc>"
    KVCALC_DATA="${CMAKE_CURRENT_SOURCE_DIR}/test_kvcalc_data")
  add_dependencies(test_kvcalc kvcalc)
  set_tests_properties(test_kvcalc PROPERTIES LABELS "unit;kvcalc")
endif()
