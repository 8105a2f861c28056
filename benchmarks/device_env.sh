# Source from the repository root on the GPU machine (tool `run`, carrying .whl and, for the farm, .redis):
#
#     source benchmarks/device_env.sh || exit
#
# Installs the carried wheels (.whl/: celery, kombu, redis, sqlalchemy, alembic, nvtx, ... for Python 3.12)
# into /tmp/site, unpacks the carried Debian redis-server (.redis/*.deb) into /tmp/redis, and exports
# PYTHONPATH / PATH / LD_LIBRARY_PATH / PYTHONUNBUFFERED. Starts nothing. The wheels and .debs are fetched
# on the development machine (benchmarks/README.md, "Device wheels").
# shellcheck shell=bash

_dsocr_root=$(pwd)
if [ ! -d "$_dsocr_root/dsocr_workers" ]; then
    echo "device_env.sh: source it from the repository root" >&2
    return 1 2>/dev/null || exit 1
fi

if ls "$_dsocr_root"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$_dsocr_root"/.whl/*.whl || { echo "device_env.sh: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
    export PYTHONPATH=/tmp/site:$_dsocr_root${PYTHONPATH:+:$PYTHONPATH}
else
    echo "device_env.sh: no .whl/ carried: Python packages as the image has them" >&2
    export PYTHONPATH=$_dsocr_root${PYTHONPATH:+:$PYTHONPATH}
fi

# bench_vendor.py's side of the vendor code: transformers 4.46.3 and the few packages the image lacks for
# it (.whl/vendor/), installed apart in /tmp/vendor-site so they never shadow the image's transformers.
if ls "$_dsocr_root"/.whl/vendor/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vendor-site \
        "$_dsocr_root"/.whl/vendor/*.whl || { echo "device_env.sh: vendor wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
fi

# dpkg -x where dpkg exists; otherwise ar + tar (a .deb is an ar archive holding data.tar.*).
_dsocr_unpack() {
    if command -v dpkg >/dev/null 2>&1; then
        dpkg -x "$1" "$2"
    else
        mkdir -p "$2"
        (cd "$(mktemp -d)" && ar x "$1" && tar -xf data.tar.* -C "$2")
    fi
}

if ls "$_dsocr_root"/.redis/*.deb >/dev/null 2>&1; then
    mkdir -p /tmp/redis
    for f in "$_dsocr_root"/.redis/*.deb; do _dsocr_unpack "$f" /tmp/redis; done
    export PATH=/tmp/redis/usr/bin:$PATH
    export LD_LIBRARY_PATH=/tmp/redis/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # Libraries the image normally has (libssl3, libatomic1): unpacked and appended only if missing, so
    # they never shadow the image's own copies for Python, torch or CUDA.
    for f in "$_dsocr_root"/.redis/fallback/*.deb; do
        [ -e "$f" ] || continue
        case "$(basename "$f")" in
            libssl3*) soname=libssl.so.3 ;;
            libatomic1*) soname=libatomic.so.1 ;;
            *) soname=$(basename "$f") ;;
        esac
        if ! ldconfig -p 2>/dev/null | grep -q "$soname"; then
            _dsocr_unpack "$f" /tmp/redis-fallback
            export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/tmp/redis-fallback/usr/lib/x86_64-linux-gnu
        fi
    done
    redis-server --version || echo "device_env.sh: redis-server does not run (ldd: $(ldd /tmp/redis/usr/bin/redis-server 2>&1 | grep 'not found'))" >&2
fi

export PYTHONUNBUFFERED=1
unset _dsocr_root
unset -f _dsocr_unpack
