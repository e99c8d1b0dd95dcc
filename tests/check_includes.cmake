# The include structure of the library (docs/api.md, "Layout"), checked as a CTest test
# (structure.includes): cmake -DROOT=<include dir> -P check_includes.cmake
#   cache/      never includes attention/, detail/ or analysis/ (a cache holds tokens
#               only, and stands on config/ and core/)
#   analysis/   never includes attention/ or detail/, nor Eigen (through core/types.hpp),
#               except head_diversity.hpp, which reads a layer's weights
#   config/     never includes Eigen
#   attention/, cache/, detail/  never include reference/ (fast paths stay apart)
if(NOT ROOT)
  message(FATAL_ERROR "set ROOT to the include directory")
endif()

set(_failures "")
function(check_folder folder pattern why)
  file(GLOB _headers "${ROOT}/kvattn/${folder}/*.hpp")
  foreach(_header IN LISTS _headers)
    get_filename_component(_name "${_header}" NAME)
    if(folder STREQUAL "analysis" AND _name STREQUAL "head_diversity.hpp")
      continue()
    endif()
    file(STRINGS "${_header}" _lines REGEX "^#include")
    foreach(_line IN LISTS _lines)
      if(_line MATCHES "${pattern}")
        list(APPEND _failures "kvattn/${folder}/${_name}: ${_line} (${why})")
      endif()
    endforeach()
  endforeach()
  set(_failures "${_failures}" PARENT_SCOPE)
endfunction()

check_folder(cache "kvattn/(attention|detail|analysis)/"
             "a cache holds tokens only and needs config/ and core/ alone")
check_folder(analysis "kvattn/(attention|detail)/|<Eigen/|kvattn/core/types.hpp"
             "the analytic module needs configs only, and no Eigen")
check_folder(config "<Eigen/|kvattn/core/types.hpp|kvattn/(attention|cache|detail)/"
             "configs stand on their own, without Eigen")
foreach(_fast attention cache detail)
  check_folder(${_fast} "kvattn/reference/" "fast paths never include the references")
endforeach()

if(_failures)
  list(JOIN _failures "\n  " _text)
  message(FATAL_ERROR "include structure broken:\n  ${_text}")
endif()
message(STATUS "include structure: ok")
