#!/usr/bin/env bash
# One node's part of a multi-node impel job under SLURM.
#
# srun starts this script once per node (--ntasks-per-node=1). It turns SLURM's variables into `impel launch`
# flags and execs `impel launch`, which starts this node's ranks (one per GPU) and joins the c10d rendezvous
# hosted on the job's first node:
#   --num_machines      $SLURM_JOB_NUM_NODES (or $SLURM_NNODES)
#   --machine_rank      $SLURM_NODEID
#   --main_process_ip   the first host of $SLURM_JOB_NODELIST (scontrol show hostnames)
#   --num_processes     nodes x processes per node ($SLURM_GPUS_ON_NODE, else the GPUs nvidia-smi lists)
# Arguments are passed on to `impel launch` (a --config_file, then the script and its arguments).
#
# Overrides: IMPEL_MAIN_PROCESS_IP, IMPEL_MAIN_PROCESS_PORT (default 29500), IMPEL_PROCESSES_PER_NODE (CPU nodes:
# set it), IMPEL_LAUNCH_ARGS (extra launch flags, e.g. "--cpu"), IMPEL_DRY_RUN=1 (print the command, run nothing).
set -euo pipefail

nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}"
node_rank="${SLURM_NODEID:-}"
if [[ -z "$nodes" || -z "$node_rank" ]]; then
    echo "impel_node.sh: SLURM_JOB_NUM_NODES/SLURM_NNODES and SLURM_NODEID are not set; start this script with" \
         "srun inside an sbatch allocation (see examples/slurm/train.sbatch)" >&2
    exit 2
fi

main_host="${IMPEL_MAIN_PROCESS_IP:-}"
if [[ -z "$main_host" ]]; then
    if ! command -v scontrol >/dev/null; then
        echo "impel_node.sh: scontrol is not on PATH to find the first node of \$SLURM_JOB_NODELIST; set" \
             "IMPEL_MAIN_PROCESS_IP to that node's address" >&2
        exit 2
    fi
    # no `| head -n 1`: with pipefail, scontrol killed by SIGPIPE after the first line would fail the script
    hosts="$(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}")"
    main_host="${hosts%%$'\n'*}"
fi

per_node="${IMPEL_PROCESSES_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
if [[ -z "$per_node" ]]; then
    per_node="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
fi
if ! [[ "$per_node" =~ ^[0-9]+$ ]] || (( per_node < 1 )); then
    echo "impel_node.sh: no GPUs found on $(hostname) (SLURM_GPUS_ON_NODE unset, nvidia-smi lists none); request" \
         "them with #SBATCH --gpus-per-node=N, or set IMPEL_PROCESSES_PER_NODE (and IMPEL_LAUNCH_ARGS=--cpu on" \
         "CPU nodes)" >&2
    exit 2
fi

cmd=(impel launch
     --num_machines "$nodes" --machine_rank "$node_rank" --num_processes "$(( nodes * per_node ))"
     --main_process_ip "$main_host" --main_process_port "${IMPEL_MAIN_PROCESS_PORT:-29500}" --rdzv_backend c10d)
if [[ -n "${IMPEL_LAUNCH_ARGS:-}" ]]; then
    read -r -a extra <<< "$IMPEL_LAUNCH_ARGS"
    cmd+=("${extra[@]}")
fi
cmd+=("$@")

if [[ -n "${IMPEL_DRY_RUN:-}" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
