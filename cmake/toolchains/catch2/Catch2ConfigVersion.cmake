# The host's Catch2 version file decides (see Catch2Config.cmake here).
find_path(LINATTN_HOST_CATCH2_DIR Catch2ConfigVersion.cmake
  PATHS /usr/lib/cmake/Catch2 /usr/share/cmake/Catch2 /usr/local/lib/cmake/Catch2
        /usr/local/share/cmake/Catch2
  NO_DEFAULT_PATH NO_CMAKE_FIND_ROOT_PATH)  # the host's, not the sysroot's
if(LINATTN_HOST_CATCH2_DIR)
  include("${LINATTN_HOST_CATCH2_DIR}/Catch2ConfigVersion.cmake")
else()
  set(PACKAGE_VERSION "0")
  set(PACKAGE_VERSION_UNSUITABLE TRUE)
endif()
