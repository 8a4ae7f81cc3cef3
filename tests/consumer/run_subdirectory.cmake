# ctest case consumer_subdirectory: build and run tests/consumer/ with
# add_subdirectory(<linattn source>).
# Extra input (-D): LINATTN_SOURCE_DIR, the linattn source tree.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")

if(NOT LINATTN_SOURCE_DIR)
  message(FATAL_ERROR "consumer_subdirectory: -DLINATTN_SOURCE_DIR=... is required")
endif()

# With LINATTN_NATIVE=ON, so linattn::linattn carries -march=native in the build tree, and
# linattn_consumer_native linked to linattn::native besides (consumer_strict builds the plain
# subdirectory); with LINATTN_BUILD_COMPILED=ON, linattn_consumer_compiled linked to
# linattn::compiled too.
linattn_consumer_build_and_run(subdirectory "-DLINATTN_SOURCE_DIR=${LINATTN_SOURCE_DIR}"
                               -DLINATTN_NATIVE=ON -DLINATTN_CONSUMER_NATIVE=ON
                               -DLINATTN_BUILD_COMPILED=ON -DLINATTN_CONSUMER_COMPILED=ON)
