#!/usr/bin/env bash
# The Python package as a newcomer meets it: `cmake --install` puts it where
# Debian's python3 looks (no PYTHONPATH), a venv made from that python3 with
# --system-site-packages imports it, and an interpreter without grpcio gets
# an ImportError naming the Debian package to install.
#   install_test.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d /tmp/fulcrum-install-XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

cmake --install "$build" --prefix "$work/prefix" >"$work/install.log" || { cat "$work/install.log"; fail "cmake --install"; }
version=$(/usr/bin/python3 -c "import sys; print('%d.%d' % sys.version_info[:2])")
site=$work/prefix/lib/python$version/dist-packages
for f in "$site/fulcrum/__init__.py" "$site/fulcrum/v1/cluster_pb2.py" "$work/prefix/bin/fulcrumctl" \
         "$work/prefix/bin/fulcrum-server"; do
  [[ -e "$f" ]] || fail "cmake --install did not install $f"
done
ls "$site"/fulcrum/_ps*.so >/dev/null 2>&1 || fail "cmake --install did not install fulcrum._ps"
# With the default prefix (/usr/local) that folder is on Debian's python3's path.
/usr/bin/python3 -c "import site, sys; sys.exit(0 if '/usr/local/lib/python$version/dist-packages' in site.getsitepackages() else 1)" ||
  fail "/usr/local/lib/python$version/dist-packages is not on /usr/bin/python3's path"
PYTHONPATH=$site /usr/bin/python3 -c "import fulcrum, fulcrum.torch; fulcrum.Tables" || fail "the installed package does not import"

# A virtual environment that sees Debian's packages.
/usr/bin/python3 -m venv --system-site-packages --without-pip "$work/venv"
PYTHONPATH=$site "$work/venv/bin/python" -c "import fulcrum; fulcrum.Client" || fail "a --system-site-packages venv cannot import fulcrum"

# An interpreter that does not see Debian's packages (-S: no site folders).
if PYTHONPATH=$site /usr/bin/python3 -S -c "import fulcrum" 2>"$work/err"; then fail "imported without grpc"; fi
grep -q "fulcrum needs the Python module 'grpc' (Debian's package python3-grpcio)" "$work/err" ||
  { cat "$work/err"; fail "the ImportError does not name python3-grpcio"; }
grep -q -- "--system-site-packages" "$work/err" || fail "the ImportError does not give the venv recipe"
echo "PASS"
