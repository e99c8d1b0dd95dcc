# cmake -DBUILD_DIR=<kvattn build> -DPREFIX=<dir> -DINCLUDEDIR=<rel> -DCMAKEDIR=<rel>
#       [-DCONFIG=<cfg>] -P install.cmake
# Installs kvattn from BUILD_DIR into a fresh PREFIX (removed first, so headers that
# no longer exist cannot linger and hide a packaging bug).
foreach(_var BUILD_DIR PREFIX INCLUDEDIR CMAKEDIR)
  if(NOT ${_var})
    message(FATAL_ERROR "install.cmake: -D${_var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${PREFIX}")
set(_config "")
if(CONFIG)
  set(_config --config "${CONFIG}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${_config}
                RESULT_VARIABLE _result)
if(NOT _result EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (${_result})")
endif()
foreach(_file ${INCLUDEDIR}/kvattn/kvattn.hpp ${CMAKEDIR}/kvattn-config.cmake
              ${CMAKEDIR}/kvattn-config-version.cmake ${CMAKEDIR}/kvattn-targets.cmake)
  if(NOT EXISTS "${PREFIX}/${_file}")
    message(FATAL_ERROR "install.cmake: ${PREFIX}/${_file} was not installed")
  endif()
endforeach()
