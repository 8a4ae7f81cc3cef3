# ctest case consumer_bare_install: the install of a user who has nothing but Eigen and a
# compiler. Configures the linattn source tree afresh with the default options while Catch2,
# Google Benchmark and Threads are hidden (CMAKE_DISABLE_FIND_PACKAGE_*), checks that the tests
# and the benchmarks are skipped with one message each, installs it (nothing is built) into a
# prefix other than the configured CMAKE_INSTALL_PREFIX, then builds and runs tests/consumer/
# against that prefix with find_package(linattn) (linattn::linattn and linattn::native), and
# with pkg-config when there is one.
# Extra input (-D): LINATTN_SOURCE_DIR, the linattn source tree.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")

if(NOT LINATTN_SOURCE_DIR)
  message(FATAL_ERROR "consumer_bare_install: -DLINATTN_SOURCE_DIR=... is required")
endif()

set(linattn_build "${WORK_DIR}/linattn")
set(configured_prefix "${WORK_DIR}/configured-prefix")  # must stay empty: --prefix wins
set(prefix "${WORK_DIR}/prefix")
file(REMOVE_RECURSE "${linattn_build}" "${configured_prefix}")

linattn_consumer_tool_args(tool_args)
message(STATUS "consumer (bare install): configure linattn without Catch2, benchmark, Threads")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${LINATTN_SOURCE_DIR}" -B "${linattn_build}" ${tool_args}
          "-DCMAKE_INSTALL_PREFIX=${configured_prefix}"
          -DCMAKE_DISABLE_FIND_PACKAGE_Catch2=ON
          -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON
          -DCMAKE_DISABLE_FIND_PACKAGE_Threads=ON
  OUTPUT_VARIABLE out
  ERROR_VARIABLE out
  RESULT_VARIABLE rc)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer_bare_install: configuring linattn failed (${rc}); it must not "
                      "need Catch2, Google Benchmark or Threads")
endif()

# One message per skipped part (CMake wraps message text, so match only its start).
foreach(part IN ITEMS tests benchmarks)
  string(REGEX MATCHALL "linattn: skipping the ${part}" hits "${out}")
  list(LENGTH hits count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "consumer_bare_install: expected one 'linattn: skipping the ${part}' "
                        "message, got ${count}")
  endif()
endforeach()
if(EXISTS "${linattn_build}/tests" OR EXISTS "${linattn_build}/bench")
  message(FATAL_ERROR "consumer_bare_install: tests/ or bench/ was configured without its "
                      "packages")
endif()

linattn_consumer_install("${linattn_build}" "${prefix}")
foreach(file IN ITEMS include/linattn/linattn.hpp
                      share/cmake/linattn/linattnConfig.cmake
                      share/cmake/linattn/linattnConfigVersion.cmake
                      share/cmake/linattn/linattnTargets.cmake
                      share/pkgconfig/linattn.pc)
  if(NOT EXISTS "${prefix}/${file}")
    message(FATAL_ERROR "consumer_bare_install: ${prefix}/${file} was not installed")
  endif()
endforeach()
if(EXISTS "${configured_prefix}")
  message(FATAL_ERROR "consumer_bare_install: the install wrote into the configured prefix "
                      "${configured_prefix}, not only into --prefix ${prefix}")
endif()

# linattn_consumer_native: the installed package's opt-in target linattn::native.
linattn_consumer_build_and_run(package "-DCMAKE_PREFIX_PATH=${prefix}"
                               -DLINATTN_CONSUMER_NATIVE=ON)
linattn_consumer_check_found_under("${prefix}")

linattn_consumer_pkg_config("${prefix}")
