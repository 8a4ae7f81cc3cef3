# Runs one negative-compilation case: SOURCE must compile with -DLINATTN_COMPILE_FAIL_CONTROL
# (so the failure is the trap, not a typo) and must fail without it, with a compiler message
# matching the regex on its first line ("// expect: <regex>").
#   cmake -DCXX=... -DSOURCE=... -DINCLUDES="a;b" -DFLAGS="..." -P check.cmake
file(STRINGS "${SOURCE}" _first LIMIT_COUNT 1)
if(NOT _first MATCHES "^// expect: (.+)$")
  message(FATAL_ERROR "${SOURCE}: the first line must be '// expect: <regex>'")
endif()
set(_expect "${CMAKE_MATCH_1}")
set(_args -std=c++17 -fsyntax-only)
foreach(_dir IN LISTS INCLUDES)
  list(APPEND _args "-I${_dir}")
endforeach()
separate_arguments(_flags UNIX_COMMAND "${FLAGS}")
list(APPEND _args ${_flags})

execute_process(COMMAND "${CXX}" ${_args} -DLINATTN_COMPILE_FAIL_CONTROL "${SOURCE}"
                RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE}: the control (-DLINATTN_COMPILE_FAIL_CONTROL) must compile:\n"
                      "${_out}")
endif()
execute_process(COMMAND "${CXX}" ${_args} "${SOURCE}"
                RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
if(_rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE}: compiled, but it must not")
endif()
if(NOT _out MATCHES "${_expect}")
  message(FATAL_ERROR "${SOURCE}: failed to compile as it should, but no message matched "
                      "'${_expect}':\n${_out}")
endif()
message(STATUS "${SOURCE}: does not compile, as expected ('${_expect}')")
