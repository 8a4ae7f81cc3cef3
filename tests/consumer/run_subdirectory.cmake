# ctest case consumer_subdirectory: build and run tests/consumer/ with
# add_subdirectory(<linattn source>).
# Extra input (-D): LINATTN_SOURCE_DIR, the linattn source tree.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")

if(NOT LINATTN_SOURCE_DIR)
  message(FATAL_ERROR "consumer_subdirectory: -DLINATTN_SOURCE_DIR=... is required")
endif()

# With LINATTN_NATIVE=ON, so linattn::linattn carries -march=native in the build tree, and
# linattn_consumer_native linked to linattn::native besides (consumer_strict builds the plain
# subdirectory), and linattn_consumer_compiled linked to linattn::compiled. That one is configured
# always (the alias target and what it hands on are checked, and its compile line must carry
# -march=native) but built and run only when this build has no linattn::compiled of its own:
# when it has (scripts/test's), consumer_installed installs that library and links it, and
# compiling the kernels again here costs two minutes of CPU.
if(LINATTN_HAS_COMPILED)
  set(CONSUMER_TARGETS linattn_consumer linattn_consumer_native)
endif()
linattn_consumer_build_and_run(subdirectory "-DLINATTN_SOURCE_DIR=${LINATTN_SOURCE_DIR}"
                               -DLINATTN_NATIVE=ON -DLINATTN_CONSUMER_NATIVE=ON
                               -DLINATTN_BUILD_COMPILED=ON -DLINATTN_CONSUMER_COMPILED=ON)
