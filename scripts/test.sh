#!/usr/bin/env bash
# The project's single test command.
#
#   1. installs the system packages the build and the tests need (Debian /
#      Ubuntu via apt, only what is missing; a fast no-op otherwise):
#        - OpenMPI        openmpi-bin libopenmpi-dev   (mpirun, mpicc)
#        - libclang       libclang-dev                 (bindgen)
#        - g++            g++                          (the emulated CUDA driver)
#        - iproute2       iproute2                     (ip netns: scripts/two_hosts.sh)
#        - OpenSlide      libopenslide0                (slides compared with OpenSlide)
#        - NVRTC          libnvrtc11.2 (Debian non-free / Ubuntu multiverse;
#                         libnvrtc12 where 11.2 is not offered)
#      and exposes NVRTC under the plain name libnvrtc.so via the symlink
#      target/nvrtc/libnvrtc.so (LD_LIBRARY_PATH, GEMS_NVRTC_LIB);
#   2. runs the whole suite: cargo test --release --features mpi (extra arguments are
#      passed on; without OpenMPI, a warning and the suite without the MPI transport). It
#      includes the GPU suite's op tests, a resnet110v2 step and the planted-bug tests on the
#      emulated CUDA driver (build.rs builds it: feature cuda-emu, on in every cargo test), here
#      with its chaos mode on (GEMS_EMU_CHAOS, seed 1 unless set) and its memory check (always
#      on); cuDNN's op tests run on the emulated cuDNN. Then the GPU op tests once more under
#      the race check (GEMS_EMU_RACECHECK) and chaos seed 2 (about 4 minutes on 2 cores). The rest of the GPU suite (16-bit steps, loss scale, training, offload,
#      schemes, a cuDNN step and offload with cuDNN; about 30 minutes on 2 cores) runs with:
#      cargo test --release --test cuda_ops -- --ignored
#   3. without extra arguments, the kernels against the references of scripts/cuda_emu/run.sh,
#      every example (examples/), the documentation's build, the
#      commands of README.md and docs/*.md (scripts/docs_check.sh), the GPU script's dry run
#      and, as root with network namespaces, two hosts on this machine (scripts/two_hosts.sh).
#
# Environment:
#   GEMS_SKIP_APT=1   do not install anything (only check and warn).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)

log()  { printf '%s\n' "$*"; }
warn() { printf 'WARNING: %s\n' "$*" >&2; }
die()  { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

# --- root / sudo -------------------------------------------------------------
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root privileges (and no sudo available) to run: $*"
    fi
}

# Run a command with its output captured; show the output only on failure.
quiet() {
    local out rc=0
    out=$(mktemp)
    "$@" >"$out" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        cat "$out" >&2
        rm -f "$out"
        printf 'ERROR: command failed (exit %s): %s\n' "$rc" "$*" >&2
        return "$rc"
    fi
    rm -f "$out"
}

# --- apt helpers ---------------------------------------------------------------
have_apt() { command -v apt-get >/dev/null 2>&1 && command -v dpkg-query >/dev/null 2>&1; }

pkg_installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

# Prints the candidate version of a package, or nothing if apt offers none.
apt_candidate() {
    local c
    c=$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2; exit}')
    if [ -n "$c" ] && [ "$c" != "(none)" ]; then printf '%s\n' "$c"; fi
}

APT_UPDATED=0
apt_update() {
    if [ "$APT_UPDATED" -eq 0 ]; then
        log "   apt-get update"
        quiet as_root apt-get update -qq
        APT_UPDATED=1
    fi
}

apt_install() {
    apt_update
    log "   apt-get install $*"
    quiet as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "$@"
}

# enable_components URI_REGEX COMPONENT...
# Adds the components to every apt source (deb822 *.sources and one-line
# *.list / sources.list) whose URI matches URI_REGEX and which already has
# "main". Idempotent; sets APT_UPDATED=0 when a file changed.
enable_components() {
    local re=$1; shift
    local comps="$*" f tmp changed=0
    local -a files=()
    shopt -s nullglob
    files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources)
    shopt -u nullglob
    for f in "${files[@]}"; do
        [ -f "$f" ] || continue
        tmp=$(mktemp)
        case "$f" in
        *.sources)
            RE="$re" COMPS="$comps" awk '
                function addmissing(line,   n, w, have, k, c, nc) {
                    sub(/[ \t]+$/, "", line)
                    n = split(line, w, /[ \t]+/)
                    for (k = 2; k <= n; k++) have[w[k]] = 1
                    if (!("main" in have)) return line
                    nc = split(ENVIRON["COMPS"], c, " ")
                    for (k = 1; k <= nc; k++) if (!(c[k] in have)) line = line " " c[k]
                    return line
                }
                function flush(   i) {
                    for (i = 1; i <= nl; i++) {
                        if (hit && buf[i] ~ /^Components:/) buf[i] = addmissing(buf[i])
                        print buf[i]
                    }
                    nl = 0; hit = 0
                }
                /^[ \t]*$/ { flush(); print; next }
                { buf[++nl] = $0; if ($0 ~ /^URIs:/ && $0 ~ ENVIRON["RE"]) hit = 1 }
                END { flush() }
            ' "$f" >"$tmp"
            ;;
        *)
            RE="$re" COMPS="$comps" awk '
                /^[ \t]*deb(-src)?[ \t]/ && $0 ~ ENVIRON["RE"] && $0 !~ /#/ {
                    line = $0; sub(/[ \t]+$/, "", line)
                    s = line; gsub(/\[[^]]*\]/, "", s)       # drop [options]
                    n = split(s, w, /[ \t]+/)
                    delete have
                    for (k = 4; k <= n; k++) have[w[k]] = 1  # deb URI SUITE COMPS...
                    if ("main" in have) {
                        nc = split(ENVIRON["COMPS"], c, " ")
                        for (k = 1; k <= nc; k++) if (!(c[k] in have)) line = line " " c[k]
                    }
                    print line; next
                }
                { print }
            ' "$f" >"$tmp"
            ;;
        esac
        if ! cmp -s "$f" "$tmp"; then
            log "   enabling apt components '$comps' in $f"
            as_root cp "$tmp" "$f"
            changed=1
        fi
        rm -f "$tmp"
    done
    if [ "$changed" -eq 1 ]; then APT_UPDATED=0; fi
    return 0
}

# --- NVRTC -------------------------------------------------------------------------
NVRTC_PKGS=(libnvrtc11.2 libnvrtc12)

# Prints the resolved path of a real libnvrtc.so.N file, or nothing.
find_nvrtc() {
    local p f=""
    if command -v dpkg-query >/dev/null 2>&1; then
        for p in "${NVRTC_PKGS[@]}"; do
            if pkg_installed "$p"; then
                f=$(dpkg -L "$p" 2>/dev/null | grep -E '/libnvrtc\.so(\.[0-9]+)+$' | head -n1 || true)
                [ -n "$f" ] && break
            fi
        done
    fi
    if [ -z "$f" ] && command -v ldconfig >/dev/null 2>&1; then
        f=$(ldconfig -p 2>/dev/null | awk '$1 ~ /^libnvrtc\.so/ {print $NF; exit}' || true)
    fi
    if [ -z "$f" ]; then
        for p in /usr/local/cuda/lib64/libnvrtc.so*; do
            [ -e "$p" ] && { f=$p; break; }
        done
    fi
    if [ -n "$f" ] && [ -e "$f" ]; then readlink -f "$f"; fi
}

nvrtc_candidate() {
    local p
    for p in "${NVRTC_PKGS[@]}"; do
        if [ -n "$(apt_candidate "$p")" ]; then printf '%s\n' "$p"; return 0; fi
    done
}

# =====================================================================================
log "== installing system packages"

OS_ID="" OS_LIKE=""
if [ -r /etc/os-release ]; then
    OS_ID=$( . /etc/os-release; printf '%s' "${ID:-}")
    OS_LIKE=$( . /etc/os-release; printf '%s' "${ID_LIKE:-}")
fi

if [ "${GEMS_SKIP_APT:-0}" = 1 ]; then
    log "   GEMS_SKIP_APT=1: not installing anything"
elif ! have_apt; then
    warn "no apt-get/dpkg on this system: cannot install OpenMPI, libclang, NVRTC automatically"
else
    missing=()
    for p in openmpi-bin libopenmpi-dev libclang-dev g++ iproute2 libopenslide0; do
        pkg_installed "$p" || missing+=("$p")
    done

    nvrtc_pkg=""
    need_nvrtc=0
    if [ -z "$(find_nvrtc)" ]; then
        need_nvrtc=1
        nvrtc_pkg=$(nvrtc_candidate)
        if [ -z "$nvrtc_pkg" ]; then
            case "$OS_ID" in
            debian)
                enable_components '(debian\.org|/debian(-security)?/?)([ \t]|$)' contrib non-free ;;
            ubuntu)
                enable_components '(ubuntu\.com|/ubuntu/?)([ \t]|$)' universe multiverse ;;
            *)
                case " $OS_LIKE " in
                *" ubuntu "*) enable_components '(ubuntu\.com|/ubuntu/?)([ \t]|$)' universe multiverse ;;
                *" debian "*) enable_components '(debian\.org|/debian(-security)?/?)([ \t]|$)' contrib non-free ;;
                esac ;;
            esac
        fi
    fi

    if [ "${#missing[@]}" -gt 0 ] || [ "$need_nvrtc" -eq 1 ]; then
        apt_update
        if [ "$need_nvrtc" -eq 1 ]; then
            nvrtc_pkg=$(nvrtc_candidate)
            if [ -n "$nvrtc_pkg" ]; then
                missing+=("$nvrtc_pkg")
            else
                warn "no NVRTC package (${NVRTC_PKGS[*]}) available from apt on ${OS_ID:-this system}; GPU kernels cannot be compiled"
            fi
        fi
        if [ "${#missing[@]}" -gt 0 ]; then apt_install "${missing[@]}"; fi
    fi
fi

for c in mpirun mpicc; do
    command -v "$c" >/dev/null 2>&1 || warn "'$c' not found on PATH (OpenMPI)"
done

nvrtc_real=$(find_nvrtc)
if [ -n "$nvrtc_real" ]; then
    mkdir -p "$ROOT/target/nvrtc"
    if [ "$(readlink "$ROOT/target/nvrtc/libnvrtc.so" 2>/dev/null || true)" != "$nvrtc_real" ]; then
        ln -sfn "$nvrtc_real" "$ROOT/target/nvrtc/libnvrtc.so"
    fi
    export LD_LIBRARY_PATH="$ROOT/target/nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export GEMS_NVRTC_LIB="$ROOT/target/nvrtc/libnvrtc.so"
    log "   NVRTC: $GEMS_NVRTC_LIB -> $nvrtc_real"
else
    warn "libnvrtc not found; GEMS_NVRTC_LIB is not set"
fi

# The slide tests compare gems' readers with libopenslide (loaded at run time): required here,
# so that they cannot pass without comparing; elsewhere they say they were skipped.
if ldconfig -p 2>/dev/null | grep -q 'libopenslide\.so\.[01]'; then
    export GEMS_REQUIRE_OPENSLIDE=1
else
    warn "libopenslide not found: the OpenSlide comparisons are skipped"
fi

# OpenMPI refuses to start as root unless told it may (containers, CI).
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# =====================================================================================
if ! command -v cargo >/dev/null 2>&1 && [ -f "${HOME:-/nonexistent}/.cargo/env" ]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi

# The MPI transport is a cargo feature: built and tested (under mpirun) wherever OpenMPI is.
features=()
if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
    features=(--features mpi)
else
    warn "OpenMPI is missing: the MPI transport is neither built nor tested"
fi

log "== cargo test --release ${features[*]}"
GEMS_EMU_CHAOS="${GEMS_EMU_CHAOS:-1}" cargo test --release "${features[@]}" "$@"

# The GPU op tests (tests/cuda_ops.rs, not the whole-model steps) once more, under the race
# check and another chaos seed: a race, an access outside device memory or an unordered copy
# fails them with the emulator's report.
log "== GPU op tests on the emulated driver: race check, chaos seed 2"
GEMS_EMU_RACECHECK=1 GEMS_EMU_CHAOS=2 cargo test --release "${features[@]}" --test cuda_ops \
    -- matches_cpu match_cpu --skip step

if [ "$#" -eq 0 ]; then
    # The kernels' sources against references of their own, compiled by g++ (about 10 s).
    log "== scripts/cuda_emu/run.sh"
    quiet scripts/cuda_emu/run.sh
    # Each example asserts what it prints (a cap held, a plan equal to the run it predicts).
    for example in custom_model plan_my_model pipeline_my_model custom_op my_schedule; do
        log "== example $example"
        cargo run --release --quiet "${features[@]}" --example "$example"
    done
    # Every public item's documentation builds, its links resolve.
    log "== cargo doc"
    RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet "${features[@]}"
    # The documentation's commands, as a reader would type them (a renamed flag fails here).
    log "== scripts/docs_check.sh"
    GEMS="$ROOT/target/release/gems" scripts/docs_check.sh
    # One rank on each of two network namespaces, OpenMPI over TCP (about 15 s), with
    # the binary the tests built (the dry run below rebuilds it with the GPU's features).
    if [ "${#features[@]}" -gt 0 ] && [ "$(id -u)" -eq 0 ] && ip netns add gems-probe 2>/dev/null; then
        ip netns del gems-probe
        log "== scripts/two_hosts.sh"
        GEMS="$ROOT/target/release/gems" scripts/two_hosts.sh
    else
        warn "scripts/two_hosts.sh skipped: it needs OpenMPI, root and network namespaces (ip netns)"
    fi
    # The GPU script's dry run: every step starts, and says "no GPU" where it needs one.
    log "== scripts/gpu/run.sh (dry run)"
    scripts/gpu/dry_run.sh
fi
