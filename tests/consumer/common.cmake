# Shared by run_installed.cmake and run_subdirectory.cmake (cmake -P scripts run by ctest).
# Inputs (-D): CONSUMER_SOURCE_DIR WORK_DIR GENERATOR [GENERATOR_PLATFORM] [GENERATOR_TOOLSET]
# [MAKE_PROGRAM] [CXX_COMPILER] [CXX_FLAGS] [EXE_LINKER_FLAGS] [EXE_SUFFIX] [CONFIG] [EIGEN3_DIR]
cmake_minimum_required(VERSION 3.19)

foreach(_var IN ITEMS CONSUMER_SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "consumer test: -D${_var}=... is required")
  endif()
endforeach()

# linattn_consumer_build_and_run(<mode> [extra configure args...])
# Configures tests/consumer/ afresh in ${WORK_DIR}/build, builds it and runs the executable.
function(linattn_consumer_build_and_run mode)
  set(build_dir "${WORK_DIR}/build")
  file(REMOVE_RECURSE "${build_dir}")

  set(configure_args -S "${CONSUMER_SOURCE_DIR}" -B "${build_dir}" -G "${GENERATOR}"
      "-DLINATTN_CONSUME=${mode}"
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
  endif()
  if(EIGEN3_DIR)
    list(APPEND configure_args "-DEigen3_DIR=${EIGEN3_DIR}")
  endif()
  list(APPEND configure_args ${ARGN})

  set(build_args --build "${build_dir}")
  if(CONFIG)
    list(APPEND build_args --config "${CONFIG}")
  endif()

  message(STATUS "consumer (${mode}): configure")
  execute_process(COMMAND "${CMAKE_COMMAND}" ${configure_args} COMMAND_ERROR_IS_FATAL ANY)
  message(STATUS "consumer (${mode}): build")
  execute_process(COMMAND "${CMAKE_COMMAND}" ${build_args} COMMAND_ERROR_IS_FATAL ANY)
  message(STATUS "consumer (${mode}): run")
  execute_process(COMMAND "${build_dir}/bin/linattn_consumer${EXE_SUFFIX}"
                  COMMAND_ERROR_IS_FATAL ANY)
  message(STATUS "consumer (${mode}): passed")
endfunction()
