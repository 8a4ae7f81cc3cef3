# shellcheck shell=bash
# Shared by scripts/test: clear what killed OpenMP processes left behind.
#   source scripts/lib/openmp.sh; linattn_clear_stale_openmp_registrations
# LLVM's OpenMP runtime (libomp 14, which clang's -fopenmp links) registers each process in
# /dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid> and removes the file when the process exits. A
# process killed with SIGKILL keeps its file: the crash test of example_streaming_sessions
# kills hundreds, and /dev/shm outlives the run. pid_max is often 32768, so a build wraps the
# pids, and a later OpenMP process handed a dead one's pid aborts at start-up when the file was
# cut short by the kill ("OMP: Error #15 ... found unknown library already initialized", or a
# bus error on an empty file). Remove this user's files whose process no longer exists.
linattn_clear_stale_openmp_registrations() {
  local file pid removed=0
  for file in /dev/shm/__KMP_REGISTERED_LIB_*_"$(id -u)"; do
    [ -e "$file" ] || continue
    pid=${file#/dev/shm/__KMP_REGISTERED_LIB_}
    pid=${pid%_*}
    case "$pid" in '' | *[!0-9]*) continue ;; esac
    if [ ! -d "/proc/$pid" ] && rm -f "$file" 2>/dev/null; then removed=$((removed + 1)); fi
  done
  if [ "$removed" -ne 0 ]; then
    echo "scripts/test: removed $removed stale OpenMP registration file(s) of killed processes from /dev/shm"
  fi
  return 0
}
