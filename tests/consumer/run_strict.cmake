# ctest case consumer_strict: build and run tests/consumer/ with add_subdirectory(<linattn
# source>) in Release, plus linattn_consumer_strict (strict.cpp, strict_steps.cpp) compiled with
# -O3 -DNDEBUG -Wall -Wextra -Werror and no -march, so a warning GCC or Clang gives on the
# optimised kernels fails the suite. LINATTN_NATIVE stays off, and the runner checks that no
# target was compiled with -march=native.
# Extra input (-D): LINATTN_SOURCE_DIR, the linattn source tree.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")

if(NOT LINATTN_SOURCE_DIR)
  message(FATAL_ERROR "consumer_strict: -DLINATTN_SOURCE_DIR=... is required")
endif()

# Release whatever this build's configuration: -O3 -DNDEBUG for GCC and Clang.
set(CONFIG Release)
linattn_consumer_build_and_run(subdirectory "-DLINATTN_SOURCE_DIR=${LINATTN_SOURCE_DIR}"
                               -DLINATTN_NATIVE=OFF -DLINATTN_CONSUMER_STRICT=ON)
