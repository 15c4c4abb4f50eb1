# Shared body of scripts/slurm_single_node.sbatch and scripts/slurm_multi_node.sbatch.
# Sourced by them inside the allocation; not meant to be run by itself.
#
# What it does, on the batch host (the allocation's first node):
#   * MASTER_ADDR = first host of $SLURM_JOB_NODELIST (scontrol show hostnames), MASTER_PORT
#     derived from the job id unless set: the c10d rendezvous endpoint of every node's torchrun;
#   * one `srun` task per node runs `torchrun --nnodes $SLURM_NNODES --nproc-per-node N
#     --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id $SLURM_JOB_ID
#     --rdzv-conf join_timeout=<timeout x 60> pretrain_moe.py --config $CONFIG <your flags>`;
#   * the job's exit status is srun's (non-zero if any rank failed); a node failure during the step
#     is SLURM's to handle: with sbatch --requeue it requeues the job once the node is DOWN (no
#     requeue here: a rank that fails on a live node fails the job). A requeued run
#     (SLURM_RESTART_COUNT >= 1) says so after the banner; it resumes with --load;
#   * a preempted job (PreemptMode=REQUEUE, with a GraceTime longer than an iteration plus a save):
#     SLURM's SIGTERM reaches torchrun and its ranks, which save and exit; the script then requeues
#     the job (scontrol requeue), which resumes with --load (sbatch --no-requeue: it says so instead);
#     under PreemptParameters=send_user_signal SLURM sends the USR1 warning instead (below), and the
#     job is requeued the same way;
#   * --exit-signal-handler is on: when the #SBATCH --signal=B:USR1@180 warning reaches this
#     shell (180 s before the time limit; `scancel --signal=USR1 --batch JOB` sends it by hand),
#     SIGTERM goes to the training ranks only, on every node, so each finishes its iteration,
#     saves (with --save) and exits 0. Not SIGTERM to torchrun: torchrun would kill its ranks
#     30 s later, in the middle of a large save. Then the script requeues the job (scontrol
#     requeue), which goes on from that save with --load: a run longer than the time limit
#     continues job after job under one job id. A job that cannot be requeued (sbatch
#     --no-requeue, JobRequeue=0) ends COMPLETED and says to resubmit with --load; so does one
#     whose Requeue is switched off while it runs (`scontrol update JobId=J Requeue=0`: save and
#     stop for good). CP_EXT_EXIT_SIGNAL_HANDLER=0 turns all of it off;
#   * several nodes: before training, every node of the job connects to MASTER_ADDR:MASTER_PORT
#     (a listener on the first node; retried for RENDEZVOUS_CHECK_SECONDS): a rendezvous address
#     some node cannot reach, or a port in use on the first node, ends the job with exit 2 and one
#     message naming the nodes and the variable, instead of torchrun's 60 s wait and traceback on
#     each node.
#
# Environment knobs (sbatch exports the submitting shell's environment to the job):
#   CONFIG            YAML config (or give it as the first argument: sbatch X.sbatch configs/Y.yaml ...)
#   CP_EXT_ROOT       repository root (default: the directory sbatch was called from)
#   CP_EXT_CPU=1      CPU mode: gloo, --device cpu, no GPUs requested (submit with --gpus-per-node=0)
#   NPROC_PER_NODE    ranks per node (default: GPUs on the node; CPU mode: $SLURM_CPUS_PER_TASK)
#   MASTER_PORT       rendezvous port (default 20000 + job id % 20000)
#   MASTER_ADDR       rendezvous host (default: the first host of SLURM_JOB_NODELIST); it must be an
#                     address of that node, which hosts torchrun's c10d store (checked: exit 2)
#   TORCHRUN          launcher command (default: torchrun, else "python3 -m torch.distributed.run")
#   RENDEZVOUS_CHECK_SECONDS  how long each node may try to connect to the rendezvous before the job
#                     is ended (default 10; several nodes only; 0 skips the check)
#   DISTRIBUTED_TIMEOUT_MINUTES  becomes pretrain_moe.py's --distributed-timeout-minutes (below)
#
# Numbers are data: NPROC_PER_NODE, MASTER_PORT (1-65535), DISTRIBUTED_TIMEOUT_MINUTES,
# RENDEZVOUS_CHECK_SECONDS and the
# SLURM_* counts used here (SLURM_JOB_ID, SLURM_JOB_NUM_NODES, SLURM_CPUS_PER_TASK,
# SLURM_CPUS_ON_NODE, SLURM_GPUS_ON_NODE) must be whole numbers (>= 1; GPUs >= 0), checked
# before any arithmetic (scripts/env_checks.sh); anything else ends the job with exit 2 and a
# message naming the variable. Empty counts as unset (the default).
#
# One timeout: --distributed-timeout-minutes N (default 10, pretrain_moe.py's) is how long a
# rank waits in a collective (every process group) and also torchrun's rendezvous
# join_timeout (N x 60 s: how long the nodes wait for each other at start; torchrun's own
# default is 600 s). N is taken as pretrain_moe.py takes it: the last --distributed-timeout-minutes
# among your flags, else $DISTRIBUTED_TIMEOUT_MINUTES (passed on as the flag), else
# `distributed-timeout-minutes: N` in the config, else 10. The banner line shows it.
# Unrelated to it: NCCL_IB_TIMEOUT (a verbs retry exponent, below) and the --signal=B:USR1@180
# lead time (one iteration plus a save must fit in it; raise it with sbatch --signal=B:USR1@600).
#
# Communication settings (GPU). Exported only where unset, so a site profile or the
# submitting shell wins:
#   CUDA_DEVICE_MAX_CONNECTIONS=1  one hardware queue per device, so megatron's TP/SP
#                                  communication kernels are scheduled before the GEMMs they
#                                  overlap with (required for TP comm overlap, cheap otherwise)
#   NCCL_DEBUG=WARN                INFO prints ring/tree topology and the transports NCCL picked
#                                  (first thing to look at when multi-node is slow or hangs)
#   NCCL_SOCKET_IFNAME             interface for NCCL's bootstrap/socket traffic, e.g. ib0,
#                                  eth0 or "^lo,docker" (exclude); set it when nodes have
#                                  several NICs and NCCL picks an unroutable one
#   NCCL_IB_HCA                    InfiniBand/RoCE adapters to use, e.g. mlx5_0,mlx5_1
#                                  (default: all); NCCL_IB_DISABLE=1 forces TCP sockets
#   NCCL_IB_GID_INDEX              RoCE only: the GID index carrying RoCEv2 (often 3)
#   NCCL_IB_TIMEOUT=22             IB verbs timeout exponent; raise on large/busy fabrics
#   NCCL_NVLS_ENABLE, NCCL_P2P_LEVEL  leave at NCCL's defaults unless debugging
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  a rank that sees an NCCL error aborts the job instead
#                                  of hanging in a collective until the timeout
#   OMP_NUM_THREADS                CPU threads per rank: cpus-per-task / ranks per node (>= 1)
# CPU mode (gloo): GLOO_SOCKET_IFNAME plays NCCL_SOCKET_IFNAME's part across nodes.

source "$(dirname "${BASH_SOURCE[0]}")/env_checks.sh"  # cp_ext_int, cp_ext_timeout_minutes

cp_ext_slurm_launch() {
    set -euo pipefail
    if [[ -z "${SLURM_JOB_ID:-}" ]]; then
        echo "error: run this inside a SLURM allocation (sbatch $0 ...)" >&2
        return 2
    fi
    # Every number from the environment is checked before any arithmetic (env_checks.sh).
    local slurm_fix="SLURM sets it inside an allocation: submit with sbatch and do not export it yourself"
    cp_ext_int SLURM_JOB_ID "" 1 "" "$slurm_fix"
    cp_ext_int SLURM_JOB_NUM_NODES "" 1 "" "$slurm_fix"
    [[ -z "${SLURM_CPUS_ON_NODE:-}" ]] || cp_ext_int SLURM_CPUS_ON_NODE "" 1 "" "$slurm_fix"
    [[ -z "${SLURM_CPUS_PER_TASK:-}" ]] || cp_ext_int SLURM_CPUS_PER_TASK "" 1 "" "submit with --cpus-per-task=N"
    [[ -z "${SLURM_GPUS_ON_NODE:-}" ]] || cp_ext_int SLURM_GPUS_ON_NODE "" 0 "" "$slurm_fix"
    cp_ext_int MASTER_PORT "$(( 20000 + SLURM_JOB_ID % 20000 ))" 1 65535 \
        "set it to a free TCP port on the first node (e.g. MASTER_PORT=29500) or unset it (20000 + job id % 20000)"
    cp_ext_int RENDEZVOUS_CHECK_SECONDS 10 0 "" \
        "set it to the seconds each node may try to reach the rendezvous (0: no check) or unset it (10)"

    local root="${CP_EXT_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
    if [[ ! -f "$root/pretrain_moe.py" ]]; then
        echo "error: $root/pretrain_moe.py not found; submit from the repository root or set CP_EXT_ROOT" >&2
        return 2
    fi
    cd "$root"

    local config="${CONFIG:-}"
    if [[ $# -gt 0 && ( "$1" == *.yaml || "$1" == *.yml ) ]]; then
        config="$1"
        shift
    fi
    if [[ -z "$config" ]]; then
        echo "error: no config: set CONFIG=configs/X.yaml or pass it as the first argument" >&2
        return 2
    fi

    local cpus_per_task="${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}"
    local device_flags=()
    local nproc
    if [[ "${CP_EXT_CPU:-0}" == 1 ]]; then
        cp_ext_int NPROC_PER_NODE "$cpus_per_task" 1 "" \
            "set it to the ranks per node (e.g. NPROC_PER_NODE=2) or unset it (--cpus-per-task ranks)"
        device_flags=(--device cpu)
    else
        local gpus="${SLURM_GPUS_ON_NODE:-}"
        if [[ -z "$gpus" ]] && command -v nvidia-smi >/dev/null 2>&1; then
            gpus="$(nvidia-smi -L | wc -l)"
        fi
        cp_ext_int NPROC_PER_NODE "${gpus:-1}" 1 "" \
            "set it to the ranks per node (e.g. NPROC_PER_NODE=8) or unset it (one per GPU: submit with --gpus-per-node=N; CP_EXT_CPU=1 for CPU ranks)"
        export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
        export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
        export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
        export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    fi
    nproc="$NPROC_PER_NODE"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cpus_per_task / nproc > 0 ? cpus_per_task / nproc : 1 ))}"
    cp_ext_timeout_minutes "$config" "$@"  # CP_EXT_TIMEOUT_MINUTES, CP_EXT_TIMEOUT_FLAGS

    MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}"
    export MASTER_ADDR MASTER_PORT

    local -a torchrun
    if [[ -n "${TORCHRUN:-}" ]]; then
        read -r -a torchrun <<<"$TORCHRUN"
    elif command -v torchrun >/dev/null 2>&1; then
        torchrun=(torchrun)
    else
        torchrun=(python3 -m torch.distributed.run)
    fi

    cp_ext_check_master_addr
    if [[ "$SLURM_JOB_NUM_NODES" -gt 1 && "$RENDEZVOUS_CHECK_SECONDS" -gt 0 ]]; then
        local python=python3  # the listener below: torchrun's own interpreter where TORCHRUN names one
        [[ "${torchrun[0]##*/}" != python* ]] || python="${torchrun[0]}"
        cp_ext_check_rendezvous_reachable "$cpus_per_task" "$python"
    fi

    echo "cp_ext: job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s) [$SLURM_JOB_NODELIST], $nproc ranks/node," \
         "rendezvous $MASTER_ADDR:$MASTER_PORT, config $config, OMP_NUM_THREADS=$OMP_NUM_THREADS" \
         "$([[ "${CP_EXT_CPU:-0}" == 1 ]] && echo "(CPU/gloo)" || echo "(GPU/NCCL)")," \
         "distributed timeout $CP_EXT_TIMEOUT_MINUTES min"
    if [[ -n "${SLURM_RESTART_COUNT:-}" && "${SLURM_RESTART_COUNT}" != 0 ]]; then
        echo "cp_ext: job $SLURM_JOB_ID was requeued (SLURM_RESTART_COUNT=$SLURM_RESTART_COUNT): with --load" \
             "this run resumes from the last complete checkpoint"
    fi
    if [[ "${CP_EXT_CPU:-0}" == 1 && "$SLURM_JOB_NUM_NODES" -gt 1 ]]; then
        # Across nodes gloo must bind to an interface the other nodes reach (srun passes
        # GLOO_SOCKET_IFNAME on to every node), and the rendezvous host must not be 127.x.
        local master_ip ifname="${GLOO_SOCKET_IFNAME:-}"
        master_ip="$(getent ahostsv4 "$MASTER_ADDR" 2>/dev/null | awk 'NR == 1 {print $1}')" || true
        echo "cp_ext: gloo across nodes: GLOO_SOCKET_IFNAME=${ifname:-"(unset: each node binds to the address its hostname resolves to)"}," \
             "rendezvous host $MASTER_ADDR = ${master_ip:-"(not resolved here)"}"
        if [[ "$master_ip" == 127.* ]]; then
            echo "cp_ext: warning: $MASTER_ADDR resolves to a loopback address on $(hostname); if the other nodes resolve" \
                 "it the same way they cannot reach the rendezvous: fix /etc/hosts or export MASTER_ADDR=<routable address>" >&2
        fi
    fi

    local -a signal_flags=()
    CP_EXT_TIME_LIMIT_WARNED=0
    if [[ "${CP_EXT_EXIT_SIGNAL_HANDLER:-1}" == 1 ]]; then
        signal_flags=(--exit-signal-handler)
        trap cp_ext_forward_exit_signal USR1
    fi

    # One task per node; torchrun starts that node's ranks and finds the others via c10d. In the
    # background, so that the USR1 trap runs while the job trains (bash runs traps between commands).
    srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task="$cpus_per_task" \
        --kill-on-bad-exit=1 \
        "${torchrun[@]}" \
        --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$nproc" \
        --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
        --rdzv-conf "join_timeout=$(( CP_EXT_TIMEOUT_MINUTES * 60 ))" --max-restarts 0 \
        pretrain_moe.py --config "$config" "${device_flags[@]}" "${signal_flags[@]}" "${CP_EXT_TIMEOUT_FLAGS[@]}" "$@" &
    local step=$! status=0
    while true; do
        wait "$step" && status=0 || status=$?
        kill -0 "$step" 2>/dev/null || break  # still running: `wait` was interrupted by the trap
    done
    if [[ "$status" != 0 || "$CP_EXT_TIME_LIMIT_WARNED" == 1 ]] && cp_ext_preempted; then
        # Preemption (PreemptMode=REQUEUE with a GraceTime) SIGTERMs the step: the ranks save and exit 0
        # (--exit-signal-handler), but torchrun, signalled itself, exits 1, and a job that ends within
        # its grace time ends FAILED, never requeued. So the job requeues itself. (Under
        # PreemptParameters=send_user_signal, SLURM 22.05: SlurmctldParameters=preempt_send_user_signal,
        # SLURM sends the USR1 warning instead: the trap below stops the ranks, which save, and torchrun
        # exits 0.)
        cp_ext_requeue "was preempted" >&2
    elif [[ "$status" == 0 && "$CP_EXT_TIME_LIMIT_WARNED" == 1 ]]; then
        # The time-limit warning stopped the ranks after a save (the ranks cannot tell the script whether
        # the run had also reached --train-iters by then; if it had, the requeued run loads the last
        # checkpoint and ends at once).
        cp_ext_requeue "stopped at the time-limit warning (USR1)"
    fi
    return "$status"
}

# Requeue this job (SLURM then ends this script; the requeued run resumes with --load), or say why not.
cp_ext_requeue() {
    local why=$1
    # Not `scontrol ... | grep -q`: grep ends at its match, and under pipefail a scontrol that then meets a
    # closed pipe would make the pipeline fail.
    local shown
    shown=" $(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | tr '\n' ' ') " || true
    if [[ "$shown" == *" Requeue=1 "* ]] && scontrol requeue "$SLURM_JOB_ID"; then
        echo "cp_ext: job $SLURM_JOB_ID $why: requeued (scontrol requeue); with --load it resumes from the last" \
             "complete checkpoint"
        sleep 600 || true  # SLURM ends the script as it requeues the job
    else
        echo "cp_ext: job $SLURM_JOB_ID $why and is not requeued (Requeue=0: sbatch --no-requeue, JobRequeue=0," \
             "or scontrol update Requeue=0): resubmit it with --load to go on"
    fi
}

# The rendezvous host, checked on the batch host (SLURM runs the batch script on the allocation's
# first node). torchrun starts the c10d store only on the node whose own name or address MASTER_ADDR
# is; if MASTER_ADDR names no address of this node (a stale export, another job's node), no node
# starts it and every node waits for it until torchrun's read timeout (60 s) ends it with a
# traceback. Both mistakes end the job here, with exit 2 and one message naming the variable.
cp_ext_check_master_addr() {
    local resolved here node
    node="$(hostname)"
    resolved="$(getent ahosts "$MASTER_ADDR" 2>/dev/null | awk '{print $1}' | sort -u | tr '\n' ' ')" || true
    if [[ -z "$resolved" ]]; then
        echo "error: MASTER_ADDR=$MASTER_ADDR does not resolve on the job's first node $node: unset MASTER_ADDR" \
             "(the first host of SLURM_JOB_NODELIST) or export it as an address of $node" >&2
        exit 2
    fi
    here=" $( { hostname -I 2>/dev/null | tr ' ' '\n'; getent ahosts "$node" 2>/dev/null | awk '{print $1}'; } \
              | awk 'NF && !seen[$1]++' | tr '\n' ' ')"
    local address
    for address in $resolved; do
        if [[ "$address" == 127.* || "$address" == ::1 || "$here" == *" $address "* ]]; then
            return 0
        fi
    done
    echo "error: MASTER_ADDR=$MASTER_ADDR (${resolved% }) is not an address of the job's first node $node" \
         "(${here:1:-1}): no node would host the rendezvous; unset MASTER_ADDR (the first host of" \
         "SLURM_JOB_NODELIST) or export it as an address of $node" >&2
    exit 2
}

# Every node connects to MASTER_ADDR:MASTER_PORT before torchrun does. torchrun's own failure there is a
# 60 s read timeout and a traceback on each node that cannot reach the first node's c10d store (an
# address on a network the other nodes are not on: a management NIC, a loopback alias, a firewall),
# and a port in use on the first node is a traceback there while the other nodes wait. A listener on
# the port here (the first node) and one srun step that connects from every node (retrying for
# RENDEZVOUS_CHECK_SECONDS, 10 by default: a few lost SYNs) name both mistakes in one message, with
# exit 2, before anything trains.
cp_ext_check_rendezvous_reachable() {
    local cpus_per_task=$1 python=$2 node ready="" unreachable
    node="$(hostname)"
    coproc CP_EXT_LISTENER { exec "$python" -c '
import os, socket, sys
port = int(sys.argv[1])
try:  # as torchrun'"'"'s TCPStore: all addresses, SO_REUSEADDR (create_server sets it)
    if socket.has_dualstack_ipv6():
        server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        server = socket.create_server(("", port))
except OSError as e:
    print(os.strerror(e.errno) if e.errno else e, flush=True)
    sys.exit(1)
print("listening", flush=True)
while True:  # let each prober close first (no TIME_WAIT on this side of the port)
    conn, _ = server.accept()
    conn.settimeout(5)
    try:
        conn.recv(1)
    except OSError:
        pass
    conn.close()
' "$MASTER_PORT" 2>&1; }
    local listener=$CP_EXT_LISTENER_PID
    read -r -t 20 ready <&"${CP_EXT_LISTENER[0]}" || true
    if [[ "$ready" != listening ]]; then
        kill "$listener" 2>/dev/null || true
        echo "error: MASTER_PORT=$MASTER_PORT cannot be listened on on the job's first node $node" \
             "(${ready:-no answer}): torchrun's rendezvous store could not start there; export MASTER_PORT as a" \
             "free port (e.g. MASTER_PORT=29500) or unset it (20000 + job id % 20000)" >&2
        exit 2
    fi
    # Each node that cannot connect prints its name. The step's output comes back here, whatever
    # SLURM_STDOUTMODE the submitting shell exported for the training step.
    unreachable="$(env -u SLURM_STDOUTMODE -u SLURM_STDERRMODE RENDEZVOUS_CHECK_SECONDS="$RENDEZVOUS_CHECK_SECONDS" \
        srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task="$cpus_per_task" bash -c '
            end=$(( SECONDS + RENDEZVOUS_CHECK_SECONDS ))
            until timeout 3 bash -c "exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT" 2>/dev/null; do
                if (( SECONDS >= end )); then hostname; exit 0; fi
                sleep 0.5
            done' 2>/dev/null)" || true
    kill "$listener" 2>/dev/null || true
    wait "$listener" 2>/dev/null || true
    if [[ -n "$unreachable" ]]; then
        echo "error: MASTER_ADDR=$MASTER_ADDR port $MASTER_PORT (the rendezvous, on the job's first node $node) is" \
             "not reachable from node(s) $(echo $unreachable) within $RENDEZVOUS_CHECK_SECONDS s (RENDEZVOUS_CHECK_SECONDS):" \
             "export MASTER_ADDR as an address of" \
             "$node on the network all nodes share (the one GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name), or" \
             "unset it (the first host of SLURM_JOB_NODELIST); if it is right, a firewall blocks port $MASTER_PORT" >&2
        exit 2
    fi
}

# Whether SLURM has preempted this job (`scontrol show job`: PreemptTime is set once it has).
cp_ext_preempted() {
    [[ "$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null)" =~ PreemptTime=[0-9] ]]  # not | grep -q (see cp_ext_requeue)
}

# The time-limit warning (USR1 to the batch shell; under PreemptParameters=send_user_signal also a
# preemption's): SIGTERM to each node's training ranks, the children of its torchrun (found by this
# job's rendezvous id in torchrun's command line).
cp_ext_forward_exit_signal() {
    CP_EXT_TIME_LIMIT_WARNED=1
    if cp_ext_preempted; then  # PreemptParameters=send_user_signal: SLURM warns a preempted job with its --signal
        echo "cp_ext: USR1 (preempted, send_user_signal): SIGTERM to the training ranks; they save and exit"
    else
        echo "cp_ext: USR1 (time limit near): SIGTERM to the training ranks; they save and exit"
    fi
    CP_EXT_RDZV_ID="--rdzv-id $SLURM_JOB_ID" srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
        bash -c 'for p in $(pgrep -u "$(id -u)" -f -- "$CP_EXT_RDZV_ID"); do pkill -TERM -P "$p"; done' || true
}
