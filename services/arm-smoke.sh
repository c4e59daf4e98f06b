#!/usr/bin/env bash
# ARM smoke test under emulation, run by hand as root on a Debian x86 machine
# (docs/development.md, "ARM under emulation").
#
# Builds Debian bookworm roots for arm64 and armhf (armv7, as 32-bit Raspberry Pi OS) with
# `debootstrap --foreign` and qemu-user-static, installs the project into each (numpy from
# Debian on armhf, where PyPI has no wheel; wheels downloaded on the host elsewhere, as the
# Dockerfile's offline build does), then:
#   swarm: an x86 coordinator on loopback, one arm64 and one armv7 worker, each under
#          emulation, compression none and a fixed data order; the weights after the run are
#          compared with an all-x86 run of the same rounds;
#   tp:    a TP pair with one armv7 rank and one x86 rank: identity, greedy text and logits
#          against the all-x86 pair.
#
#   sudo bash services/arm-smoke.sh                      # everything, log in CACHE/arm-smoke.log
#   sudo bash services/arm-smoke.sh --quick              # CI's bounded part: one armv7 worker,
#                                                        # one round
#
# Options: --cache DIR (roots, wheels and logs; default /var/cache/foundry-arm, reused on the
# next run), --rounds N (swarm rounds, default 3), --arch LIST (default arm64,armhf),
# --only roots|install|swarm|tp, --model FILE.gguf (the TP pair's model; default: the swarm
# run's weights), --quick. Emulated work runs under `nice -n 10`.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

CACHE=/var/cache/foundry-arm
ROUNDS=3
ARCHES=arm64,armhf
ONLY=""
QUICK=0
TP_MODEL=""
while [ $# -gt 0 ]; do
    case $1 in
        --cache) CACHE=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --arch) ARCHES=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --model) TP_MODEL=$(realpath "$2"); shift 2 ;;
        --quick) QUICK=1; ROUNDS=1; ARCHES=armhf; shift ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
IFS=, read -r -a ARCH_LIST <<<"$ARCHES"
PY=${PYTHON:-python3}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$CACHE"
LOG=$CACHE/arm-smoke.log
SMOKE_NAME="ARM SMOKE TEST"
# shellcheck source=services/lib.sh
. services/lib.sh
require_root "apt-get, binfmt_misc, debootstrap, chroot"

log "tools: qemu-user-static, debootstrap, binfmt-support from Debian"
if ! command -v qemu-aarch64-static >/dev/null || ! command -v qemu-arm-static >/dev/null \
    || ! command -v debootstrap >/dev/null || ! command -v update-binfmts >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        qemu-user-static debootstrap binfmt-support >/dev/null
fi
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
for fmt in qemu-aarch64 qemu-arm; do
    [ -e "/proc/sys/fs/binfmt_misc/$fmt" ] || update-binfmts --enable "$fmt"
    # F (fix binary): the kernel opens the interpreter now, so it works inside a chroot.
    grep -q '^flags: .*F' "/proc/sys/fs/binfmt_misc/$fmt" \
        || fail "binfmt $fmt lacks the F flag; the interpreter would not be found in a chroot"
done

# root_argv ROOT CMD...: sets ROOT_ARGV to the command line that runs CMD in ROOT under
# emulation, with /proc and /dev mounted in a private mount namespace (the mounts vanish with
# the command; nothing is left mounted). Each step execs the next, so a command started in the
# background with it keeps one pid from nice to CMD itself.
root_argv() {
    local root=$1; shift
    ROOT_ARGV=(nice -n 10 unshare --mount --propagation private -- sh -euc '
        root=$1; shift
        mount -t proc proc "$root/proc"
        mount --rbind /dev "$root/dev"
        exec chroot "$root" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin \
            HOME=/root LANG=C.UTF-8 OPENBLAS_NUM_THREADS=1 "$@"
    ' in_root "$root" "$@")
}
in_root() { root_argv "$@"; "${ROOT_ARGV[@]}"; }

# build_root ARCH: a bookworm root with python3 (and Debian's numpy on armhf), cached.
build_root() {
    local arch=$1 root=$CACHE/root-$1 include=python3,python3-venv
    [ "$arch" = armhf ] && include=$include,python3-numpy
    if [ -e "$root/.foundry-root-ok" ]; then
        echo "  $arch: cached root $root"
        return
    fi
    # A half-built root (interrupted run) is rebuilt; nothing is mounted in it (in_root's
    # mounts are private to their own namespace).
    rm -rf --one-file-system "$root"
    local ts
    ts=$(date +%s)
    debootstrap --foreign --arch="$arch" --variant=minbase --include="$include" \
        bookworm "$root" "$MIRROR" >"$CACHE/debootstrap-$arch.log" 2>&1 \
        || fail "debootstrap first stage for $arch: $(tail -3 "$CACHE/debootstrap-$arch.log")"
    in_root "$root" /debootstrap/debootstrap --second-stage \
        >>"$CACHE/debootstrap-$arch.log" 2>&1 \
        || fail "debootstrap second stage for $arch: $(tail -3 "$CACHE/debootstrap-$arch.log")"
    rm -rf "$root"/var/cache/apt/archives/*.deb
    touch "$root/.foundry-root-ok"
    echo "  $arch: built $root in $(( $(date +%s) - ts )) s"
}

log "bookworm roots (${ARCH_LIST[*]}) in $CACHE"
for arch in "${ARCH_LIST[@]}"; do
    build_root "$arch"
    in_root "$CACHE/root-$arch" python3 -c \
        'import platform, sys; print("  ", platform.machine(), "python", sys.version.split()[0])'
done
[ "$ONLY" = roots ] && { log "roots ready"; exit 0; }

# -- the project in each root -------------------------------------------------------------------

log "wheels, downloaded on the host (as services/smoke-test.sh does for the image)"
mapfile -t REQS < <(requirements)
PLATFORMS_arm64=(manylinux2014_aarch64 manylinux_2_17_aarch64 manylinux_2_28_aarch64 linux_aarch64)
PLATFORMS_armhf=(linux_armv7l manylinux2014_armv7l manylinux_2_17_armv7l manylinux_2_31_armv7l)
# Debian's packages in the armhf root, for what PyPI has no armv7 wheel of: numpy (1.24, what
# 32-bit Raspberry Pi OS has), PyYAML and cffi (gguf's and cryptography's dependencies).
DEBIAN_armhf=(python3-numpy python3-yaml python3-cffi)
fetch_wheels() {  # ARCH: $CACHE/wheels-ARCH, cp311 wheels of every dependency
    local arch=$1 dir=$CACHE/wheels-$1 plat=() p
    local -n platforms=PLATFORMS_$1
    for p in "${platforms[@]}"; do plat+=(--platform "$p"); done
    mkdir -p "$dir"
    if [ "$arch" = arm64 ]; then
        "$PY" -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
            "${plat[@]}" -d "$dir" "${REQS[@]}" 2>&1 | quiet_pip
        return
    fi
    # armhf: numpy has no wheel, so the resolver cannot run for this platform; the arm64 set
    # (same names and versions) is fetched one by one without dependencies, numpy and the
    # packages Debian provides left out.
    local w name version spec
    for w in "$CACHE"/wheels-arm64/*.whl; do
        name=$(basename "$w" | cut -d- -f1); version=$(basename "$w" | cut -d- -f2)
        case $name in numpy|pyyaml|cffi) continue ;; esac
        case $w in *-none-any.whl) cp "$w" "$dir/"; continue ;; esac
        spec="$name==$version"
        # cryptography 46 and later need cffi 2, which has no armv7 wheel and is newer than
        # Debian's (1.15): 45 is the last that Debian's cffi serves.
        [ "$name" = cryptography ] && spec="cryptography>=42,<46"
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
            --implementation cp "${plat[@]}" -d "$dir" "$spec" 2>&1 | quiet_pip \
            || fail "no armv7 wheel of $spec on PyPI"
    done
}
fetch_wheels arm64
for arch in "${ARCH_LIST[@]}"; do
    [ "$arch" = arm64 ] || fetch_wheels "$arch"
    echo "  $arch: $(ls "$CACHE/wheels-$arch" | wc -l) wheels"
done

# install ARCH: the working tree's files (tracked and new, not ignored) into /opt/foundry-src,
# a venv /opt/foundry (seeing Debian's numpy on armhf), `pip install --no-index`.
install_project() {
    local arch=$1 root=$CACHE/root-$1 stamp src
    # Reinstalled when what pip installs changes: the package's files or the wheels.
    stamp=$( (cd "$REPO" && git ls-files -z --cached --others --exclude-standard -- \
        pyproject.toml README.md src | xargs -0 sha256sum 2>/dev/null; ls "$CACHE/wheels-$arch") \
        | sha256sum | cut -c1-16)
    if [ "$(cat "$root/opt/.foundry-installed" 2>/dev/null)" = "$stamp" ]; then
        echo "  $arch: installed (unchanged since the last run)"
        return
    fi
    if [ "$arch" = armhf ]; then
        local missing=()
        for deb in "${DEBIAN_armhf[@]}"; do
            in_root "$root" dpkg -s "$deb" >/dev/null 2>&1 || missing+=("$deb")
        done
        if [ ${#missing[@]} -gt 0 ]; then
            cp /etc/resolv.conf "$root/etc/resolv.conf"
            in_root "$root" apt-get update -qq
            in_root "$root" env DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        fi
    fi
    src=$root/opt/foundry-src
    rm -rf "$src" "$root/opt/wheels" && mkdir -p "$src"
    git -C "$REPO" ls-files -z --cached --others --exclude-standard \
        | (cd "$REPO" && xargs -0 tar -c --ignore-failed-read 2>/dev/null) | tar -x -C "$src"
    cp -r "$CACHE/wheels-$arch" "$root/opt/wheels"
    local venv_flags=()
    [ "$arch" = armhf ] && venv_flags=(--system-site-packages)
    in_root "$root" rm -rf /opt/foundry
    in_root "$root" python3 -m venv "${venv_flags[@]}" /opt/foundry
    in_root "$root" /opt/foundry/bin/pip install -q --no-index --find-links /opt/wheels \
        --disable-pip-version-check /opt/foundry-src 2>&1 | quiet_pip
    echo "$stamp" >"$root/opt/.foundry-installed"
}

log "the project in each root"
for arch in "${ARCH_LIST[@]}"; do
    ts=$(date +%s)
    install_project "$arch"
    in_root "$CACHE/root-$arch" /opt/foundry/bin/python -c \
        'import platform, numpy, foundry; print("  ", platform.machine(), "numpy", numpy.__version__, "foundry", foundry.__version__)'
    echo "  $arch ready in $(( $(date +%s) - ts )) s"
done
[ "$ONLY" = install ] && { log "installed"; exit 0; }

# -- swarm: x86 coordinator, emulated workers; the same rounds all on x86 ------------------------

# The host's foundry: the repository's venv (bash .ci/run makes it) unless FOUNDRY_PY says.
HOST_PY=${FOUNDRY_PY:-$REPO/.venv/bin/python}
[ -x "$HOST_PY" ] || fail "no $HOST_PY: run bash .ci/run once (or set FOUNDRY_PY)"
WORK=$CACHE/run
rm -rf "$WORK" && mkdir -p "$WORK"
# One corpus file for every machine: the host's bundled docs, written out (each root's own
# Python may bundle another version of them).
CORPUS=$WORK/corpus.txt
"$HOST_PY" -c 'import sys; from pydoc_data.topics import topics
sys.stdout.write("".join(topics[k].rstrip("\n") + "\n\n" for k in sorted(topics)))' >"$CORPUS"
for arch in "${ARCH_LIST[@]}"; do cp "$CORPUS" "$CACHE/root-$arch/opt/corpus.txt"; done

PIDS=()
cleanup() {
    local rc=$? pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    log "exit $rc; log $LOG"
}
trap cleanup EXIT

# worker NAME ARCH LOGFILE: starts one worker (x86 on the host, else emulated in its root).
# Every worker gets the same profile, so every one gets the same micro-batch.
worker() {
    local name=$1 arch=$2 logf=$3
    local args=(worker --coordinator "127.0.0.1:$PORT" --worker-id "$name" --profile laptop_light)
    if [ "$arch" = x86 ]; then
        OPENBLAS_NUM_THREADS=1 "$HOST_PY" -m foundry "${args[@]}" --data "$CORPUS" >"$logf" 2>&1 &
    else
        root_argv "$CACHE/root-$arch" /opt/foundry/bin/foundry "${args[@]}" --data /opt/corpus.txt
        "${ROOT_ARGV[@]}" >"$logf" 2>&1 &
    fi
    PIDS+=($!)
}

# swarm_run NAME ARCH ARCH: a coordinator on the host and two workers; the weights after
# ROUNDS steps end up in $WORK/NAME/checkpoints.
swarm_run() {
    local name=$1 dir=$WORK/$1 ts
    ts=$(date +%s)
    mkdir -p "$dir"
    OPENBLAS_NUM_THREADS=1 "$HOST_PY" -m foundry coordinator --listen 127.0.0.1:0 \
        --admin-listen 127.0.0.1:0 --checkpoint-dir "$dir/checkpoints" --data "$CORPUS" \
        --max-steps "$ROUNDS" --global-batch 16 --min-workers 2 --no-rebalance \
        --checkpoint-every 1 --compression none >"$dir/coordinator.log" 2>&1 &
    local coordinator=$!
    PIDS+=("$coordinator")
    for _ in $(seq 60); do
        PORT=$(sed -n 's/^coordinator listening: workers 127.0.0.1:\([0-9]*\),.*/\1/p' \
            "$dir/coordinator.log")
        [ -n "$PORT" ] && break
        sleep 1
    done
    [ -n "$PORT" ] || fail "the coordinator did not start: $(tail -5 "$dir/coordinator.log")"
    worker "$name-a" "$2" "$dir/worker-$2-a.log"
    local first=$!
    worker "$name-b" "$3" "$dir/worker-$3-b.log"
    local second=$!
    # Workers exit 0 when training is done.
    wait "$first" || fail "worker $2 exited $?: $(tail -5 "$dir/worker-$2-a.log")"
    wait "$second" || fail "worker $3 exited $?: $(tail -5 "$dir/worker-$3-b.log")"
    kill "$coordinator"; wait "$coordinator" || true
    grep -E "step [0-9]+: loss" "$dir/coordinator.log" | sed 's/^.*INFO [a-z.]*: /  /'
    grep -q "step $ROUNDS: loss" "$dir/coordinator.log" \
        || fail "$name did not reach step $ROUNDS: $(tail -5 "$dir/coordinator.log")"
    if grep -E "step [0-9]+: loss" "$dir/coordinator.log" | grep -qv "from 2 workers"; then
        echo "  note: a round closed without both workers (see $dir/coordinator.log)"
    fi
    echo "  $name: $ROUNDS rounds in $(( $(date +%s) - ts )) s"
}

if [ -z "$ONLY" ] || [ "$ONLY" = swarm ]; then
    if [ "$QUICK" = 1 ]; then
        log "swarm, $ROUNDS round(s): x86 coordinator, an x86 worker and an armv7 worker"
        swarm_run mixed x86 armhf
        log "the same round(s), all on x86"
        swarm_run x86 x86 x86
    else
        log "swarm, $ROUNDS rounds: x86 coordinator, one arm64 and one armv7 worker (emulated)"
        swarm_run mixed arm64 armhf
        log "the same rounds, all on x86 (coordinator and two workers)"
        swarm_run x86 x86 x86
    fi
    log "weights: mixed against all-x86"
    "$HOST_PY" services/arm_smoke.py compare-weights "$WORK/mixed/checkpoints" \
        "$WORK/x86/checkpoints"
    log "where a difference comes from: one gradient and two kernels on each machine"
    OPENBLAS_NUM_THREADS=1 "$HOST_PY" services/arm_smoke.py probe "$WORK/probe-x86.npz" \
        --data "$CORPUS"
    for arch in "${ARCH_LIST[@]}"; do
        cp services/arm_smoke.py "$CACHE/root-$arch/opt/arm_smoke.py"
        in_root "$CACHE/root-$arch" /opt/foundry/bin/python /opt/arm_smoke.py probe \
            "/opt/probe.npz" --data /opt/corpus.txt
        mv "$CACHE/root-$arch/opt/probe.npz" "$WORK/probe-$arch.npz"
        "$HOST_PY" services/arm_smoke.py compare-probes "$WORK/probe-x86.npz" \
            "$WORK/probe-$arch.npz"
    done
fi

# -- tensor-parallel pair: an x86 leader and an armv7 worker rank ---------------------------------

if { [ -z "$ONLY" ] || [ "$ONLY" = tp ]; } && [ "$QUICK" = 0 ] \
    && [[ " ${ARCH_LIST[*]} " == *" armhf "* ]]; then
    log "TP pair: x86 leader (rank 0), armv7 worker (rank 1, emulated), TCP gates"
    MODEL=$WORK/model.gguf
    if [ -n "$TP_MODEL" ]; then
        cp "$TP_MODEL" "$MODEL"
    elif [ -d "$WORK/x86/checkpoints" ]; then
        "$HOST_PY" -m foundry export --checkpoint "$WORK/x86/checkpoints" --out "$MODEL"
    else
        "$HOST_PY" -m foundry model init --preset tiny --out "$MODEL"
    fi
    cp "$MODEL" "$CACHE/root-armhf/opt/model.gguf"
    TP_PORT=$("$HOST_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    ts=$(date +%s)
    OPENBLAS_NUM_THREADS=1 "$HOST_PY" services/arm_smoke.py tp-leader --model "$MODEL" \
        --port "$TP_PORT" --tokens 32 >"$WORK/tp-leader.log" 2>&1 &
    LEADER=$!
    PIDS+=("$LEADER")
    for _ in $(seq 60); do grep -q "listening" "$WORK/tp-leader.log" && break; sleep 1; done
    root_argv "$CACHE/root-armhf" /opt/foundry/bin/foundry tp-worker --model /opt/model.gguf \
        --leader "127.0.0.1:$TP_PORT" --no-shm --gate-timeout 120
    "${ROOT_ARGV[@]}" >"$WORK/tp-worker.log" 2>&1 &
    TP_WORKER=$!
    PIDS+=("$TP_WORKER")
    tp_rc=0
    wait "$LEADER" || tp_rc=$?
    wait "$TP_WORKER" || true
    sed 's/^/  /' "$WORK/tp-leader.log"
    grep -E "identity|ready|paired" "$WORK/tp-worker.log" | sed 's/^/  worker: /' || true
    echo "  TP pair: $(( $(date +%s) - ts )) s"
    [ "$tp_rc" = 0 ] || fail "the mixed pair did not match one x86 process (rc $tp_rc)"
fi

log "ARM SMOKE TEST PASSED in $(( $(date +%s) - t0 )) s"
