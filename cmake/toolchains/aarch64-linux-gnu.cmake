# Cross build for 64-bit ARM Linux with Debian's g++-aarch64-linux-gnu; ctest runs the binaries
# under qemu-user (Debian: apt-get install g++-aarch64-linux-gnu qemu-user). See
# docs/development.md:
#   cmake --preset aarch64 && cmake --build build/aarch64 && ctest --preset aarch64
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(LINATTN_CROSS_TRIPLE aarch64-linux-gnu)
set(LINATTN_CROSS_SYSROOT /usr/${LINATTN_CROSS_TRIPLE})  # Debian's libc6-dev-arm64-cross etc.
set(CMAKE_C_COMPILER ${LINATTN_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${LINATTN_CROSS_TRIPLE}-g++)

# ctest (and Catch2's test discovery at build time) runs every test executable through qemu;
# -L: the dynamic loader and shared libraries (libstdc++, libgomp) are the sysroot's.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L ${LINATTN_CROSS_SYSROOT})

# Libraries and headers from the aarch64 sysroot only (SQLite, for one, is found there or not at
# all: the host's is x86-64), programs from the host.
set(CMAKE_FIND_ROOT_PATH ${LINATTN_CROSS_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
# Packages from both: Eigen's config (/usr/share/eigen3/cmake) is the host's and architecture
# independent.
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# Catch2 2.x: the host's package links libCatch2WithMain.a, which is x86-64 code, and puts its
# headers in /usr/include, which the cross compiler must not search; catch2/ uses the host's
# headers and CMake scripts and compiles Catch2WithMain for the target.
set(Catch2_DIR "${CMAKE_CURRENT_LIST_DIR}/catch2" CACHE PATH
    "Catch2 2.x for the cross build (cmake/toolchains/catch2)")
