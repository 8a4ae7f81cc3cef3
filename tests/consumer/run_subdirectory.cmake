# ctest case consumer_subdirectory: build and run tests/consumer/ with
# add_subdirectory(<linattn source>).
# Extra input (-D): LINATTN_SOURCE_DIR, the linattn source tree.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")

if(NOT LINATTN_SOURCE_DIR)
  message(FATAL_ERROR "consumer_subdirectory: -DLINATTN_SOURCE_DIR=... is required")
endif()

# With LINATTN_NATIVE=ON, so linattn::linattn carries -march=native in the build tree, and
# linattn_consumer_native linked to linattn::native besides (consumer_strict builds the plain
# subdirectory). linattn_consumer_compiled, linked to linattn::compiled, is built here only when
# this build has no linattn::compiled of its own: when it has (scripts/test's), consumer_installed
# installs that library and links it, and compiling the kernels again here would check nothing
# more (the same target definition) for two minutes of CPU.
set(compiled_args -DLINATTN_BUILD_COMPILED=ON -DLINATTN_CONSUMER_COMPILED=ON)
if(LINATTN_HAS_COMPILED)
  set(compiled_args "")
endif()
linattn_consumer_build_and_run(subdirectory "-DLINATTN_SOURCE_DIR=${LINATTN_SOURCE_DIR}"
                               -DLINATTN_NATIVE=ON -DLINATTN_CONSUMER_NATIVE=ON ${compiled_args})
