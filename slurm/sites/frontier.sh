# Site file for Frontier/LUMI-class machines (AMD Instinct GPUs, HPE Slingshot-11, ROCm), sourced by the batch
# script (slurm.site). Every value marked EDIT depends on the machine's modules and install paths.
# RCCL reads the NCCL_* names. Without the aws-ofi-rccl plugin RCCL falls back to TCP sockets over Slingshot.

module load PrgEnv-gnu rocm craype-accel-amd-gfx90a        # EDIT: gfx90a = MI250X (Frontier, LUMI-G)
export LD_LIBRARY_PATH="/path/to/aws-ofi-rccl/lib:${LD_LIBRARY_PATH:-}"   # EDIT: the RCCL libfabric plugin
export NCCL_NET_GDR_LEVEL=3              # GPU-direct RDMA over the Slingshot NICs
export NCCL_SOCKET_IFNAME=hsn            # bootstrap over the high-speed NICs (hsn0..hsn3), not the management net
export FI_MR_CACHE_MONITOR=userfaultfd   # the default memory-registration monitor hangs RCCL collectives here
export FI_CXI_DISABLE_HOST_REGISTER=1    # GPU allocations can deadlock with host registration in the CXI provider
export FI_CXI_DEFAULT_CQ_SIZE=131072     # large jobs overflow the default completion queue
# MIOpen compiles kernels into a per-user database; on a shared home it contends between ranks: per-job instead.
export MIOPEN_USER_DB_PATH="${TMPDIR:-/tmp}/miopen-${SLURM_JOB_ID:-local}"
export MIOPEN_CUSTOM_CACHE_DIR="$MIOPEN_USER_DB_PATH"
mkdir -p "$MIOPEN_USER_DB_PATH"
# Slurm binds GPUs through ROCR_VISIBLE_DEVICES (--gpus-per-task / --gpu-bind); an inherited HIP_VISIBLE_DEVICES would
# renumber them a second time inside each task.
unset HIP_VISIBLE_DEVICES
# Each task its own GPUs, the closest to its cores (OLCF's Frontier guide launches GPU jobs with --gpus-per-task
# and --gpu-bind=closest): the batch script adds --gpus-per-task=N --gpu-bind=$MILES_GPU_BIND to each srun (N = 1
# for a trainer rank, engine_tp / engine_nodes for an engine task) and the workers index their GPUs from 0.
export MILES_GPU_BIND=closest
# export NCCL_DEBUG=INFO FI_LOG_LEVEL=warn   # debug a hang at the first collective
