#!/usr/bin/env bash
# Prints the path of a CPython >= 3.13.14 (NeMo-RL HEAD's and nemo-gym >= 0.5's floor), providing one if needed:
#   1. $GYM_BRIDGE_PYTHON / $UV_PYTHON if set, 2. the base of ./.venv's, 3. one built here before,
#   4. one uv already finds, 5. `uv python install`, 6. a build from Debian's python3.13 source package, cached in $GYM_BRIDGE_CACHE (built once, ~4 min on 2 cores).
# Progress goes to stderr; stdout is only the interpreter's path.
set -euo pipefail

VERSION=3.13.15
DEBIAN_VERSION=3.13.15-1
REQUEST=">=3.13.14,<3.14"
CACHE=${GYM_BRIDGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gym-bridge}
PREFIX=$CACHE/python-$VERSION
UV=${UV:-uv}

say() { echo "[python313] $*" >&2; }

ok() {  # true if $1 is a Python in REQUEST's range
    "$1" -c 'import sys; sys.exit(not ((3, 13, 14) <= sys.version_info[:3] < (3, 14)))' 2>/dev/null
}

for wanted in "${GYM_BRIDGE_PYTHON:-}" "${UV_PYTHON:-}"; do
    if [ -n "$wanted" ]; then
        path=$(command -v "$wanted" || echo "$wanted")
        ok "$path" || { say "$wanted is not a Python $REQUEST"; exit 1; }
        echo "$path"; exit 0
    fi
done

# The checkout's own environment, made by an earlier `make setup`: its base interpreter.
if [ -x .venv/bin/python ] && ok .venv/bin/python; then
    .venv/bin/python -c 'import sys; print(sys._base_executable)'; exit 0
fi

if ok "$PREFIX/bin/python3.13"; then echo "$PREFIX/bin/python3.13"; exit 0; fi

if found=$($UV python find --no-project "$REQUEST" 2>/dev/null) && ok "$found"; then echo "$found"; exit 0; fi

if $UV python install --no-progress "$REQUEST" >&2 2>/dev/null \
   && found=$($UV python find --no-project "$REQUEST" 2>/dev/null) && ok "$found"; then
    echo "$found"; exit 0
fi

# Debian's sid source package, fetched with a private sources list and state so the system's apt is untouched.
say "no Python $REQUEST found; building CPython $VERSION from Debian's source package into $PREFIX (once, ~4 min)"
command -v apt-get >/dev/null || { say "no apt-get here: install Python $REQUEST and set UV_PYTHON to it"; exit 1; }
uri=$(grep -hoE '^URIs: *[^ ]+' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -n1 | awk '{print $2}')
[ -n "$uri" ] || uri=$(grep -hoE '^deb +(\[[^]]*\] +)?[^ ]+' /etc/apt/sources.list 2>/dev/null | grep -v security | head -n1 | awk '{print $NF}')
[ -n "$uri" ] || { say "cannot find the system's Debian mirror in /etc/apt; set UV_PYTHON to a Python $REQUEST"; exit 1; }

work=$CACHE/build-python-$VERSION
rm -rf "$work"
mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/src"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri sid main" >"$work/apt/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" -qq update >&2
(cd "$work/src" && apt-get "${apt_opts[@]}" -qq source --download-only "python3.13=$DEBIAN_VERSION" >&2)
tar -C "$work/src" -xf "$work"/src/python3.13_"$VERSION".orig.tar.*
cd "$work/src/Python-$VERSION"
say "configure"
./configure --prefix="$PREFIX" --with-ensurepip=install >"$work/configure.log" 2>&1 \
    || { say "configure failed: $work/configure.log"; exit 1; }
say "make -j$(nproc)"
make -j"$(nproc)" >"$work/make.log" 2>&1 || { say "make failed: $work/make.log"; exit 1; }
make install >"$work/install.log" 2>&1 || { say "make install failed: $work/install.log"; exit 1; }
ok "$PREFIX/bin/python3.13" || { say "the build in $PREFIX does not run"; exit 1; }
rm -rf "$work"
say "built $("$PREFIX/bin/python3.13" --version) in $PREFIX"
echo "$PREFIX/bin/python3.13"
