#!/usr/bin/env bash
# Two hosts on one machine: two network namespaces (gems-a 10.77.0.1, gems-b 10.77.0.2, each
# with its own hostname) joined by a veth pair, one MPI rank on each, OpenMPI over TCP only
# (btl tcp,self: no shared-memory transport; pml ob1, so UCX cannot pick one either). mpirun
# runs in gems-a and starts the second host's daemon through a launcher that enters gems-b
# (what ssh does between real hosts). Checks:
#   1. a pipeline (mp, 2 stages) spanning both hosts has the per-step losses of the same run
#      over threads, to the last bit, and its messages crossed the veth pair;
#   2. kill -9 of the rank on gems-b, once a checkpoint exists, ends the job within seconds;
#   3. the newest checkpoint resumes over both hosts to the end of the run.
# Needs root, iproute2 (ip netns), util-linux (unshare), OpenMPI and a binary built with
# `cargo build --release --features mpi` (GEMS: another path). About 15 s on 2 cores.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEMS=$(realpath "${GEMS:-target/release/gems}")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

die() { printf 'two_hosts: FAILED: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces)"
for tool in ip unshare mpirun; do
    command -v "$tool" >/dev/null || die "needs $tool"
done
[ -x "$GEMS" ] || die "no $GEMS; build it with cargo build --release --features mpi"

WORK=$(mktemp -d /tmp/gems-two-hosts.XXXXXX)
cleanup() {
    ip netns pids gems-a 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns pids gems-b 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del gems-a 2>/dev/null || true
    ip netns del gems-b 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
# Namespaces an interrupted run left behind.
ip netns del gems-a 2>/dev/null || true
ip netns del gems-b 2>/dev/null || true

ip netns add gems-a
ip netns add gems-b
ip link add veth-a netns gems-a type veth peer name veth-b netns gems-b
ip -n gems-a addr add 10.77.0.1/24 dev veth-a
ip -n gems-b addr add 10.77.0.2/24 dev veth-b
for h in a b; do
    ip -n "gems-$h" link set lo up
    ip -n "gems-$h" link set "veth-$h" up
done

# The launcher mpirun calls as `AGENT HOST COMMAND...` to start its daemon on HOST, as it
# would call ssh: the command runs in that host's namespace under that host's name.
cat >"$WORK/agent" <<'EOF'
#!/bin/sh
case $1 in
10.77.0.1) h=a ;;
10.77.0.2) h=b ;;
*) echo "no host $1" >&2; exit 1 ;;
esac
shift
exec ip netns exec "gems-$h" unshare --uts /bin/sh -c "hostname gems-$h && $*"
EOF
chmod +x "$WORK/agent"
printf '10.77.0.1 slots=1\n10.77.0.2 slots=1\n' >"$WORK/hostfile"

# mpirun in gems-a, one rank per host, everything over the veth pair's subnet.
two_hosts() {
    ip netns exec gems-a unshare --uts /bin/sh -c 'hostname gems-a && exec "$@"' sh \
        mpirun -np 2 --hostfile "$WORK/hostfile" --map-by node \
        --mca plm_rsh_agent "$WORK/agent" \
        --mca oob_tcp_if_include 10.77.0.0/24 \
        --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 \
        "$@"
}
veth_bytes() { ip netns exec gems-a cat /sys/class/net/veth-a/statistics/tx_bytes; }
losses() { grep -o '"loss":[^,}]*' "$1"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

RUN=(train --dtype f64 --steps 4 --classes 4 --seed=3 --scheme mp --split 2 --parts 2
    --order 1f1b --batch-size 4)

# 1. Both hosts against threads.
t0=$(now)
sent0=$(veth_bytes)
two_hosts "$GEMS" "${RUN[@]}" --transport mpi --metrics "$WORK/hosts.jsonl" >"$WORK/hosts.log" 2>&1 ||
    { cat "$WORK/hosts.log"; die "the two-host run failed"; }
sent=$(($(veth_bytes) - sent0))
t1=$(now)
"$GEMS" "${RUN[@]}" --metrics "$WORK/local.jsonl" >"$WORK/local.log" 2>&1 ||
    { cat "$WORK/local.log"; die "the run over threads failed"; }
[ "$(losses "$WORK/hosts.jsonl" | wc -l)" -eq 4 ] || die "the two-host run has no 4 steps of metrics"
diff <(losses "$WORK/hosts.jsonl") <(losses "$WORK/local.jsonl") >&2 ||
    die "per-step losses differ between two hosts and threads"
# The pipeline's activations and gradients, not only the launcher's messages, crossed.
[ "$sent" -gt 1000000 ] || die "only $sent bytes crossed the veth pair"
equal="4 steps, losses equal to threads bit for bit, $sent bytes over veth in $(secs "$t0" "$t1") s"
echo "two_hosts: $equal"

# 2. A rank killed on gems-b ends the job.
CK=$WORK/ck
LONG=(train --steps 20 --batch-size 8 --seed=5 --scheme mp --split 2 --transport mpi
    --checkpoint "$CK" --checkpoint-every 1)
two_hosts "$GEMS" "${LONG[@]}" >"$WORK/long.log" 2>&1 &
job=$!
deadline=$((SECONDS + 120))
until [ -e "$CK/step-000002.safetensors" ]; do
    kill -0 "$job" 2>/dev/null || { cat "$WORK/long.log"; die "the run ended before its checkpoint"; }
    [ "$SECONDS" -lt "$deadline" ] || die "no checkpoint after 120 s"
    sleep 0.1
done
# The gems processes (ranks) in the namespaces named.
ranks_in() {
    for ns in "$@"; do
        for p in $(ip netns pids "$ns"); do
            [ "$(cat "/proc/$p/comm" 2>/dev/null)" = gems ] && echo "$p"
        done
    done
}
rank_b=$(ranks_in gems-b)
[ "$(echo "$rank_b" | wc -w)" -eq 1 ] || die "no single rank on gems-b: '$rank_b'"
kill -9 "$rank_b"
killed=$(now)
# Ended: mpirun gone and no rank left on either host, within 10 s.
limit=$((SECONDS + 10))
while kill -0 "$job" 2>/dev/null || [ -n "$(ranks_in gems-a gems-b)" ]; do
    [ "$SECONDS" -lt "$limit" ] || die "the job still runs 10 s after the kill"
    sleep 0.1
done
took=$(secs "$killed" "$(now)")
status=0
wait "$job" || status=$?
[ "$status" -ne 0 ] || die "the job succeeded with a rank killed"
last=$(ls "$CK"/step-*.safetensors | sort | tail -n 1)
echo "two_hosts: rank on gems-b killed after $(basename "$last"); the job ended in $took s (exit $status)"

# 3. The newest checkpoint resumes over both hosts.
t0=$(now)
two_hosts "$GEMS" "${LONG[@]}" --resume "$last" >"$WORK/resume.log" 2>&1 ||
    { cat "$WORK/resume.log"; die "resuming $(basename "$last") failed"; }
[ -e "$CK/step-000020.safetensors" ] || die "the resumed run did not reach step 20"
echo "two_hosts: resumed from $(basename "$last") to step 20 in $(secs "$t0" "$(now)") s"
echo "two_hosts: passed"
