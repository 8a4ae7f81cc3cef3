# Catch2 2.x for a cross build (the toolchain files beside this directory set Catch2_DIR here).
# The host's single header and CMake scripts (Catch.cmake) are architecture independent and used
# as they are; the host's libCatch2WithMain.a is host code, so Catch2::Catch2WithMain is compiled
# here for the target, once, from the same two lines.
if(TARGET Catch2::Catch2)
  return()
endif()

find_path(LINATTN_HOST_CATCH2_INCLUDE_DIR catch2/catch.hpp
  PATHS /usr/include /usr/local/include
  NO_DEFAULT_PATH NO_CMAKE_FIND_ROOT_PATH)
if(NOT LINATTN_HOST_CATCH2_DIR OR NOT LINATTN_HOST_CATCH2_INCLUDE_DIR)
  set(Catch2_FOUND FALSE)
  set(Catch2_NOT_FOUND_MESSAGE "the host's Catch2 2.x (Debian: apt-get install catch2) not found")
  return()
endif()

list(APPEND CMAKE_MODULE_PATH "${LINATTN_HOST_CATCH2_DIR}")  # include(Catch)

# The header through a directory of its own: CMake leaves /usr/include off the command line
# (an implicit directory), and a cross compiler must not search it (host C headers).
set(_linattn_catch2_dir "${CMAKE_BINARY_DIR}/linattn_cross_catch2")
file(MAKE_DIRECTORY "${_linattn_catch2_dir}/include")
if(NOT EXISTS "${_linattn_catch2_dir}/include/catch2")
  file(CREATE_LINK "${LINATTN_HOST_CATCH2_INCLUDE_DIR}/catch2"
       "${_linattn_catch2_dir}/include/catch2" SYMBOLIC)
endif()
add_library(Catch2::Catch2 INTERFACE IMPORTED)
set_target_properties(Catch2::Catch2 PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "${_linattn_catch2_dir}/include")

set(_linattn_catch2_main "${_linattn_catch2_dir}/catch_with_main.cpp")
if(NOT EXISTS "${_linattn_catch2_main}")
  file(WRITE "${_linattn_catch2_main}" "#define CATCH_CONFIG_MAIN\n#include <catch2/catch.hpp>\n")
endif()
add_library(linattn_cross_catch2_main STATIC EXCLUDE_FROM_ALL "${_linattn_catch2_main}")
target_link_libraries(linattn_cross_catch2_main PUBLIC Catch2::Catch2)
target_compile_features(linattn_cross_catch2_main PUBLIC cxx_std_11)
add_library(Catch2::Catch2WithMain ALIAS linattn_cross_catch2_main)
set(Catch2_FOUND TRUE)
