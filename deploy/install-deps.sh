#!/usr/bin/env bash
# install-deps.sh - every build and test dependency of tqkv on Debian 12 (apt-get).
# Idempotent and fast when everything is present. CUDA/NCCL are optional: they are
# used when the CUDA toolkit is installed (nvcc, nccl.h), never installed here.
set -euo pipefail

PKGS=(
  build-essential cmake pkg-config git ca-certificates
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler protobuf-compiler-grpc
  libprotobuf-dev libssl-dev liburing-dev grpc-proto libjemalloc-dev check libsubunit-dev libzstd-dev zstd
  libmicrohttpd-dev
  libc-ares-dev dnsmasq-base gnuplot-nox
  python3 python3-venv util-linux python3-numpy python3-grpcio python3-protobuf python3-prometheus-client
  python3-cffi python3-torch
  redis-server openssl clang libclang-rt-14-dev clang-format
  prometheus
  curl procps iproute2
)
# Python packages from PyPI (the deploy tests' schema validators, ...) go into virtual
# environments that deploy/python-env.sh builds from pinned sets (deploy/python/*.txt);
# they need python3-venv and flock (util-linux) here.

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# kubectl (for `kubectl kustomize` in the deploy tests): use one if present,
# otherwise Debian's kubernetes-client.
if ! command -v kubectl >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq kubernetes-client >/dev/null || true
fi

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "install-deps: CUDA toolkit found ($(ls -d /usr/local/cuda 2>/dev/null || command -v nvcc))"
else
  echo "install-deps: no CUDA toolkit; building the CPU path only"
fi
echo "install-deps: ok"
