# Shared by run_installed.cmake and run_subdirectory.cmake (cmake -P scripts run by ctest).
# Inputs (-D): CONSUMER_SOURCE_DIR WORK_DIR GENERATOR [GENERATOR_PLATFORM] [GENERATOR_TOOLSET]
# [MAKE_PROGRAM] [CXX_COMPILER] [CXX_FLAGS] [EXE_LINKER_FLAGS] [EXE_SUFFIX] [CONFIG] [EIGEN3_DIR]
# [CONFIG_FLAGS_NAME CONFIG_FLAGS] (CMAKE_CXX_FLAGS_<CONFIG> of the build, used when CONFIG matches)
# (and by run_bare_install.cmake and run_strict.cmake)
cmake_minimum_required(VERSION 3.19)

foreach(_var IN ITEMS CONSUMER_SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "consumer test: -D${_var}=... is required")
  endif()
endforeach()

# linattn_consumer_tool_args(<out_var>)
# The configure arguments every nested build shares: this build's generator, compiler, flags,
# configuration and Eigen.
function(linattn_consumer_tool_args out_var)
  set(configure_args -G "${GENERATOR}"
      "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF"
      "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
      "-DCMAKE_EXE_LINKER_FLAGS=${EXE_LINKER_FLAGS}")
  if(GENERATOR_PLATFORM)
    list(APPEND configure_args -A "${GENERATOR_PLATFORM}")
  endif()
  if(GENERATOR_TOOLSET)
    list(APPEND configure_args -T "${GENERATOR_TOOLSET}")
  endif()
  if(MAKE_PROGRAM)
    list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
  endif()
  if(CXX_COMPILER)
    list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
  endif()
  if(CONFIG)
    list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONFIG}")
    if(CONFIG_FLAGS_NAME STREQUAL CONFIG)
      string(TOUPPER "${CONFIG}" config_upper)
      list(APPEND configure_args "-DCMAKE_CXX_FLAGS_${config_upper}=${CONFIG_FLAGS}")
    endif()
  endif()
  if(EIGEN3_DIR)
    list(APPEND configure_args "-DEigen3_DIR=${EIGEN3_DIR}")
  endif()
  set(${out_var} "${configure_args}" PARENT_SCOPE)
endfunction()

# linattn_consumer_build_and_run(<mode> [extra configure args...])
# Configures tests/consumer/ afresh in ${WORK_DIR}/build, builds it and runs its executables
# (bin/linattn_consumer*).
function(linattn_consumer_build_and_run mode)
  set(build_dir "${WORK_DIR}/build")
  file(REMOVE_RECURSE "${build_dir}")

  linattn_consumer_tool_args(tool_args)
  set(configure_args -S "${CONSUMER_SOURCE_DIR}" -B "${build_dir}" ${tool_args}
      "-DLINATTN_CONSUME=${mode}" ${ARGN})

  set(build_args --build "${build_dir}")
  if(CONSUMER_TARGETS)  # only these (the caller's variable); the others are configured only
    list(APPEND build_args --target ${CONSUMER_TARGETS})
  endif()
  if(CONFIG)
    list(APPEND build_args --config "${CONFIG}")
  endif()

  message(STATUS "consumer (${mode}): configure")
  execute_process(COMMAND "${CMAKE_COMMAND}" ${configure_args} COMMAND_ERROR_IS_FATAL ANY)
  message(STATUS "consumer (${mode}): build")
  execute_process(COMMAND "${CMAKE_COMMAND}" ${build_args} COMMAND_ERROR_IS_FATAL ANY)
  file(GLOB executables LIST_DIRECTORIES false "${build_dir}/bin/linattn_consumer*${EXE_SUFFIX}")
  if(NOT executables)
    message(FATAL_ERROR "consumer (${mode}): no executable in ${build_dir}/bin")
  endif()
  foreach(exe IN LISTS executables)
    get_filename_component(name "${exe}" NAME)
    message(STATUS "consumer (${mode}): run ${name}")
    execute_process(COMMAND "${exe}" COMMAND_ERROR_IS_FATAL ANY)
  endforeach()
  linattn_consumer_check_march_native("${build_dir}")
  message(STATUS "consumer (${mode}): passed")
endfunction()

# linattn_consumer_check_march_native(<build_dir>)
# The targets the consumer listed in expect_march_native (those linked to linattn::native, and
# all of them under LINATTN_NATIVE=ON, with GCC or Clang) must have been compiled with
# -march=native, and no other (unless this build's own flags have a -march). Checked in
# compile_commands.json (Makefile and Ninja generators).
function(linattn_consumer_check_march_native build_dir)
  if(NOT EXISTS "${build_dir}/compile_commands.json")
    if(EXISTS "${build_dir}/expect_march_native" AND GENERATOR MATCHES "Ninja|Makefiles")
      message(FATAL_ERROR "consumer: ${build_dir}/compile_commands.json was not written")
    endif()
    return()
  endif()
  set(expected "")
  if(EXISTS "${build_dir}/expect_march_native")
    file(READ "${build_dir}/expect_march_native" expected)
  endif()
  file(READ "${build_dir}/compile_commands.json" json)
  string(JSON count LENGTH "${json}")
  math(EXPR last "${count} - 1")
  foreach(i RANGE ${last})
    string(JSON command ERROR_VARIABLE no_command GET "${json}" ${i} command)
    if(no_command)
      string(JSON command GET "${json}" ${i} arguments)
    endif()
    if(NOT command MATCHES "CMakeFiles[/\\](linattn_consumer[a-z_]*)\\.dir[/\\]")
      continue()
    endif()
    set(target "${CMAKE_MATCH_1}")
    list(FIND expected "${target}" at)
    if(at GREATER -1 AND NOT command MATCHES "-march=native")
      message(FATAL_ERROR "consumer: ${target} was compiled without -march=native: ${command}")
    elseif(at EQUAL -1 AND command MATCHES "-march=native" AND NOT CXX_FLAGS MATCHES "-march")
      message(FATAL_ERROR "consumer: ${target} was compiled with -march=native: ${command}")
    endif()
  endforeach()
  if(expected)
    message(STATUS "consumer: -march=native on the compile lines of ${expected} only")
  endif()
endfunction()

# linattn_consumer_install(<build_dir> <prefix>)
# Installs a configured linattn build tree into a fresh <prefix>.
function(linattn_consumer_install build_dir prefix)
  file(REMOVE_RECURSE "${prefix}")
  set(install_args --install "${build_dir}" --prefix "${prefix}")
  if(CONFIG)
    list(APPEND install_args --config "${CONFIG}")
  endif()
  message(STATUS "consumer (package): install into ${prefix}")
  execute_process(COMMAND "${CMAKE_COMMAND}" ${install_args} COMMAND_ERROR_IS_FATAL ANY)
endfunction()

# linattn_consumer_check_found_under(<prefix>)
# The package the last consumer build found must have come from <prefix>, not from anywhere
# else on the system.
function(linattn_consumer_check_found_under prefix)
  file(STRINGS "${WORK_DIR}/build/CMakeCache.txt" _dir_line REGEX "^linattn_DIR:")
  string(REGEX REPLACE "^linattn_DIR:[A-Z]+=" "" _found_dir "${_dir_line}")
  file(REAL_PATH "${prefix}" _real_prefix)
  file(REAL_PATH "${_found_dir}" _real_found)
  string(FIND "${_real_found}" "${_real_prefix}/" _at)
  if(NOT _at EQUAL 0)
    message(FATAL_ERROR "consumer: linattn was found in '${_found_dir}', "
                        "not under the install prefix '${prefix}'")
  endif()
endfunction()

# linattn_consumer_pkg_config(<prefix>)
# Builds and runs tests/consumer/ against <prefix>/share/pkgconfig/linattn.pc with CMake's
# pkg-config support; skipped, with a message, when there is no pkg-config.
function(linattn_consumer_pkg_config prefix)
  find_program(LINATTN_PKG_CONFIG NAMES pkg-config pkgconf)
  if(NOT LINATTN_PKG_CONFIG)
    message(STATUS "consumer (pkg-config): SKIPPED, no pkg-config found "
                   "(Debian: apt-get install pkg-config)")
    return()
  endif()
  # This linattn.pc ahead of every other, then eigen3.pc beside the Eigen this build used
  # (<prefix>/share/eigen3/cmake -> <prefix>/share/pkgconfig), then the caller's path.
  set(pc_path "${prefix}/share/pkgconfig")
  if(EIGEN3_DIR AND EXISTS "${EIGEN3_DIR}/../../pkgconfig/eigen3.pc")
    get_filename_component(eigen_pc_dir "${EIGEN3_DIR}/../../pkgconfig" ABSOLUTE)
    list(APPEND pc_path "${eigen_pc_dir}")
  endif()
  if(NOT "$ENV{PKG_CONFIG_PATH}" STREQUAL "")
    list(APPEND pc_path "$ENV{PKG_CONFIG_PATH}")
  endif()
  if(NOT CMAKE_HOST_WIN32)
    string(REPLACE ";" ":" pc_path "${pc_path}")
  endif()
  set(ENV{PKG_CONFIG_PATH} "${pc_path}")
  linattn_consumer_build_and_run(pkg-config "-DPKG_CONFIG_EXECUTABLE=${LINATTN_PKG_CONFIG}"
                                 "-DLINATTN_EXPECT_PREFIX=${prefix}")
endfunction()
