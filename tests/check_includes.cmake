# The include structure of the library (docs/api.md, "Layout"), checked as a CTest test
# (structure.includes): cmake -DROOT=<include dir> -P check_includes.cmake
#   cache/      never includes attention/, detail/ or analysis/ (a cache holds tokens
#               only, and stands on config/ and core/)
#   analysis/   never includes attention/ or detail/, nor Eigen (through core/types.hpp),
#               except head_diversity.hpp, which reads a layer's weights
#   config/     never includes Eigen
#   attention/, cache/, detail/  never include reference/ (fast paths stay apart)
#   every header outside distributed/ (kvattn.hpp too) never includes distributed/ or
#               <mpi.h>: kvattn::kvattn needs no MPI, only kvattn::mpi does
if(NOT ROOT)
  message(FATAL_ERROR "set ROOT to the include directory")
endif()

set(_failures "")
# check_folder(<folder> <pattern> <why> [<exempt header>]): folder "" is include/kvattn
# itself.
function(check_folder folder pattern why)
  set(_dir "kvattn")
  if(folder)
    set(_dir "kvattn/${folder}")
  endif()
  file(GLOB _headers "${ROOT}/${_dir}/*.hpp")
  foreach(_header IN LISTS _headers)
    get_filename_component(_name "${_header}" NAME)
    if(ARGC GREATER 3 AND _name STREQUAL "${ARGV3}")
      continue()
    endif()
    file(STRINGS "${_header}" _lines REGEX "^#include")
    foreach(_line IN LISTS _lines)
      if(_line MATCHES "${pattern}")
        list(APPEND _failures "${_dir}/${_name}: ${_line} (${why})")
      endif()
    endforeach()
  endforeach()
  set(_failures "${_failures}" PARENT_SCOPE)
endfunction()

check_folder(cache "kvattn/(attention|detail|analysis)/"
             "a cache holds tokens only and needs config/ and core/ alone")
check_folder(analysis "kvattn/(attention|detail)/|<Eigen/|kvattn/core/types.hpp"
             "the analytic module needs configs only, and no Eigen" head_diversity.hpp)
check_folder(config "<Eigen/|kvattn/core/types.hpp|kvattn/(attention|cache|detail)/"
             "configs stand on their own, without Eigen")
foreach(_fast attention cache detail)
  check_folder(${_fast} "kvattn/reference/" "fast paths never include the references")
endforeach()
# Every folder but distributed/, and the headers directly in include/kvattn.
file(GLOB _entries RELATIVE "${ROOT}/kvattn" "${ROOT}/kvattn/*")
set(_core_folders "")
foreach(_entry IN LISTS _entries)
  if(IS_DIRECTORY "${ROOT}/kvattn/${_entry}" AND NOT _entry STREQUAL "distributed")
    list(APPEND _core_folders "${_entry}")
  endif()
endforeach()
foreach(_core "" ${_core_folders})
  check_folder("${_core}" "kvattn/distributed/|[<\"]mpi\\.h[>\"]"
               "only kvattn::mpi needs MPI: the core headers never include it")
endforeach()

if(_failures)
  list(JOIN _failures "\n  " _text)
  message(FATAL_ERROR "include structure broken:\n  ${_text}")
endif()
message(STATUS "include structure: ok")
