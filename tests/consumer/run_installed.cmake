# ctest case consumer_installed: install this build tree into a fresh prefix, then build and run
# tests/consumer/ against it with find_package(linattn), and with pkg-config when there is one.
# Extra input (-D): LINATTN_BINARY_DIR, the build tree to install.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")

if(NOT LINATTN_BINARY_DIR)
  message(FATAL_ERROR "consumer_installed: -DLINATTN_BINARY_DIR=... is required")
endif()

set(prefix "${WORK_DIR}/prefix")
linattn_consumer_install("${LINATTN_BINARY_DIR}" "${prefix}")

linattn_consumer_build_and_run(package "-DCMAKE_PREFIX_PATH=${prefix}"
                               "-DLINATTN_CONSUMER_COMPILED=${LINATTN_HAS_COMPILED}")
linattn_consumer_check_found_under("${prefix}")

linattn_consumer_pkg_config("${prefix}")
