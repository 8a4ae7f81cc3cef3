# shellcheck shell=bash
# Shared by scripts/test and scripts/bench: install the Debian packages a build needs.
#   source scripts/lib/deps.sh; linattn_install_deps pkg...
# Only absent packages are installed; `apt-get update` runs only when something is missing.
# scripts/test also installs pkg-config: its consumer tests build against the installed
# linattn.pc (and skip that part, with a message, where pkg-config is missing). Installing
# linattn itself needs only libeigen3-dev, cmake and a compiler.

linattn_nproc() {
  nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2
}

linattn_install_deps() {
  if ! command -v dpkg >/dev/null 2>&1; then
    echo "deps: no dpkg (not Debian/Ubuntu); make sure these are installed: $*" >&2
    return 0
  fi

  local missing=() pkg
  for pkg in "$@"; do
    if ! dpkg -s "$pkg" 2>/dev/null | grep -q '^Status: install ok installed'; then
      missing+=("$pkg")
    fi
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    return 0
  fi

  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
      sudo=(sudo)
    else
      echo "deps: missing packages (${missing[*]}) and not root without sudo; install them first" >&2
      return 1
    fi
  fi

  echo "deps: installing ${missing[*]}" >&2
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# Prints "-G Ninja" when ninja exists and the build dir is not configured yet (a configured
# build keeps its generator).
linattn_generator_args() {
  local build_dir=$1
  if [ ! -f "$build_dir/CMakeCache.txt" ] && [ -z "${CMAKE_GENERATOR:-}" ] \
     && command -v ninja >/dev/null 2>&1; then
    printf '%s\n' -G Ninja
  fi
}
