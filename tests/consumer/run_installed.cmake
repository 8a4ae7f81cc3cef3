# ctest case consumer_installed: install this build tree into a fresh prefix, then build and run
# tests/consumer/ against it with find_package(linattn).
# Extra input (-D): LINATTN_BINARY_DIR, the build tree to install.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")

if(NOT LINATTN_BINARY_DIR)
  message(FATAL_ERROR "consumer_installed: -DLINATTN_BINARY_DIR=... is required")
endif()

set(prefix "${WORK_DIR}/prefix")
file(REMOVE_RECURSE "${prefix}")

set(install_args --install "${LINATTN_BINARY_DIR}" --prefix "${prefix}")
if(CONFIG)
  list(APPEND install_args --config "${CONFIG}")
endif()
message(STATUS "consumer (package): install into ${prefix}")
execute_process(COMMAND "${CMAKE_COMMAND}" ${install_args} COMMAND_ERROR_IS_FATAL ANY)

linattn_consumer_build_and_run(package "-DCMAKE_PREFIX_PATH=${prefix}")

# The package must have come from the fresh prefix, not from anywhere else on the system.
file(STRINGS "${WORK_DIR}/build/CMakeCache.txt" _dir_line REGEX "^linattn_DIR:")
string(REGEX REPLACE "^linattn_DIR:[A-Z]+=" "" _found_dir "${_dir_line}")
file(REAL_PATH "${prefix}" _real_prefix)
file(REAL_PATH "${_found_dir}" _real_found)
string(FIND "${_real_found}" "${_real_prefix}/" _at)
if(NOT _at EQUAL 0)
  message(FATAL_ERROR "consumer_installed: linattn was found in '${_found_dir}', "
                      "not under the install prefix '${prefix}'")
endif()
