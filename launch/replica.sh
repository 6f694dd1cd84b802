#!/usr/bin/env bash
# Start one replica group of one cluster; restart it if it dies.
#
#   launch/replica.sh [--no-restart] [--max-restarts N] [--ranks G] [--gpu-slot S] [--nnodes N --node-rank K --rdzv HOST:PORT]
#                     CLUSTER REPLICA GLOBAL_ADDR CLUSTER_ADDRS [overrides...] [-- python my_train.py [args...]]
#
#   CLUSTER, REPLICA  this replica group's cluster id and index in its cluster (0-based)
#   GLOBAL_ADDR       the global lighthouse, e.g. http://coord:29510
#   CLUSTER_ADDRS     every cluster's lighthouse, comma-separated, in cluster order,
#                     e.g. http://hostA:29511,http://hostB:29511
#   overrides         hydra overrides shared by the whole job (topology, model, sync, ...)
#   -- PROGRAM...     run a user's program on hier_localsgd's API (docs/api.md) instead of
#                     the built-in trainer; it reads its identity, the addresses and the
#                     overrides from HIER_LOCALSGD_OVERRIDES (a JSON list) and is supervised
#                     the same way (restarts, torchrun, stop file)
#
# Run the same command on each host with its own CLUSTER/REPLICA. Nothing else needs
# to be shared: every replica group creates its own stores and finds its peers
# through the lighthouses' quorums. Set run.hostname=<address peers can reach> when
# this host's name does not resolve on the other hosts.
#
# A replica group that exits non-zero is restarted (as torchelastic or Slurm would)
# after RESTART_DELAY seconds (default 2), at most --max-restarts times (default 100);
# it rejoins its cluster and heals from a live peer. Exit code 2 (configuration
# error) is never retried. --no-restart runs it once.
#
# Several ranks per replica group: --ranks G runs the group with torchrun, G ranks on
# this host (topology.ranks_per_replica must be G, or G*N with --nnodes N). torchrun
# restarts the whole group when a rank dies (--max-restarts times, then this script's
# own loop takes over); one log file per rank goes to <run.dir>/logs/c<C>r<R>.ranks and
# the console shows rank 0. A rank that exits 2 (a configuration error, a group that
# keeps poisoning) leaves <run.dir>/replicas/c<C>r<R>/stopped: torchrun's restarts then
# exit 2 at once and this script does not restart the group. A group spanning hosts: the
# same command on each of its N hosts with --nnodes N --node-rank K --rdzv HOST:PORT (a free port on the group's first
# host, node rank 0; the rendezvous's stores listen on HOST's address and rank 0's, not every
# interface). RUN_DIR sets where rank logs go when run.dir is not among the overrides.
#
# GPUs: --gpu-slot S (this group's index among the groups started on this host, 0, 1, ...)
# puts rank k on GPU S*G+k, every process on a GPU of its own (train.gpu_slot); a host with
# too few GPUs for the slot is refused in one line unless train.share_gpus=true.
set -uo pipefail
restart=1; max_restarts=100; ranks=1; nnodes=1; node_rank=0; rdzv=""; gpu_slot=""
while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in
    --no-restart) restart=0; shift ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    --ranks) ranks="$2"; shift 2 ;;
    --gpu-slot) gpu_slot="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --rdzv) rdzv="$2"; shift 2 ;;
    *) echo "replica.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
if [[ $# -lt 4 ]]; then
  sed -n '2,39p' "$0" >&2; exit 2
fi
cluster="$1"; replica="$2"; global_addr="$3"; cluster_addrs="$4"; shift 4
overrides=(); program=()
while [[ $# -gt 0 ]]; do
  if [[ "$1" == "--" ]]; then shift; program=("$@"); break; fi
  overrides+=("$1"); shift
done
overrides=("run.cluster=$cluster" "run.replica=$replica" ${gpu_slot:+"train.gpu_slot=$gpu_slot"}
           "lighthouse.global_addr='$global_addr'"
           "lighthouse.cluster_addrs=[${cluster_addrs}]" ${overrides[@]+"${overrides[@]}"})
if [[ ${#program[@]} -gt 0 ]]; then
  # A user's program: its overrides travel in the environment (hier_localsgd/job.py).
  HIER_LOCALSGD_OVERRIDES=$("${PYTHON:-python3}" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${overrides[@]}")
  export HIER_LOCALSGD_OVERRIDES
  train=("${program[@]}")
else
  train=(-m hier_localsgd train "${overrides[@]}")
fi
run_dir="${RUN_DIR:-runs/latest}"
for a in "${overrides[@]}"; do [[ "$a" == run.dir=* ]] && run_dir="${a#run.dir=}"; done
if [[ $ranks -gt 1 || $nnodes -gt 1 ]]; then
  py="${PYTHON:-python3}"
  if [[ ${#program[@]} -gt 0 ]]; then  # torchrun runs a script with the program's python, or a command with --no-python
    if [[ "$(basename "${program[0]}")" == python* ]]; then py="${program[0]}"; train=("${program[@]:1}"); else train=(--no-python "${program[@]}"); fi
  fi
  if [[ $nnodes -gt 1 ]]; then
    [[ -n "$rdzv" ]] || { echo "replica.sh: --nnodes needs --rdzv HOST:PORT" >&2; exit 2; }
    # The rendezvous's stores bound to an address, not every interface (rendezvous.py's hl-c10d).
    mapfile -t where < <("$py" -m hier_localsgd.launch.rendezvous --span "$nnodes" "$node_rank" "$rdzv" "c${cluster}r${replica}")
    [[ ${#where[@]} -gt 0 ]] || { echo "replica.sh: $py -m hier_localsgd.launch.rendezvous failed (torchrun's python must import hier_localsgd; PYTHON sets it)" >&2; exit 2; }
  else
    # One host: the rendezvous in a file, no listener on every interface
    # (hier_localsgd/launch/rendezvous.py); a fresh file for every launch (the loop below).
    rdzv_file="$run_dir/logs/c${cluster}r${replica}.ranks/rendezvous"
    mkdir -p "$(dirname "$rdzv_file")"
    mapfile -t where < <("$py" -m hier_localsgd.launch.rendezvous "$rdzv_file")  # the python that runs torchrun
    [[ ${#where[@]} -gt 0 ]] || { echo "replica.sh: $py -m hier_localsgd.launch.rendezvous failed (torchrun's python must import hier_localsgd; PYTHON sets it)" >&2; exit 2; }
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  fi
  cmd=("$py" -m torch.distributed.run "${where[@]}" --nproc-per-node "$ranks"
       --max-restarts "$max_restarts" --tee 3 --local-ranks-filter 0
       --log-dir "$run_dir/logs/c${cluster}r${replica}.ranks" "${train[@]}")
elif [[ ${#program[@]} -gt 0 ]]; then
  cmd=("${program[@]}")
else
  cmd=("${PYTHON:-python3}" "${train[@]}")
fi
# A multi-rank group that stopped for good (exit 2 on a rank, e.g. a poison limit) leaves
# this file: torchrun's own exit code is then not 2 (core/runtime/status.py stop_path).
stopped="$run_dir/replicas/c${cluster}r${replica}/stopped"
rm -f "$stopped"
restarts=0
child=0
trap 'if [[ $child -ne 0 ]]; then kill -TERM "$child" 2>/dev/null; wait "$child"; fi; exit 143' TERM INT
while true; do
  [[ -z "${rdzv_file:-}" ]] || rm -f "$rdzv_file"  # an earlier launch's rendezvous
  "${cmd[@]}" & child=$!
  wait "$child"; rc=$?; child=0
  if [[ $rc -eq 0 ]]; then exit 0; fi
  if [[ $rc -ne 2 && -f "$stopped" ]]; then rc=2; fi
  if [[ $rc -eq 2 || $restart -eq 0 || $restarts -ge $max_restarts ]]; then
    echo "replica.sh: c${cluster}r${replica} exited with $rc; not restarting" >&2
    exit "$rc"
  fi
  restarts=$((restarts + 1))
  echo "replica.sh: c${cluster}r${replica} exited with $rc; restart $restarts/$max_restarts in ${RESTART_DELAY:-2}s" >&2
  sleep "${RESTART_DELAY:-2}"
done
