# Site file for AMD Instinct MI300X/MI325X (gfx942) and MI350X/MI355X (gfx950) nodes: 8 GPUs joined by Infinity
# Fabric (XGMI), an RDMA NIC per GPU (InfiniBand or RoCE). Sourced by the batch script (slurm.site). One file for both
# chips: every setting below applies to both, and the one that differs (the GPU architecture) lists both.
# Values marked EDIT depend on the machine. RCCL reads the NCCL_* names. Sources: docs/hpc.md, "AMD MI300X / MI355X".

# module load rocm                       # EDIT: site-specific (many MI300X clusters have ROCm in /opt/rocm, no module)
export NCCL_SOCKET_IFNAME=ens50f0np0     # EDIT: the interface RCCL bootstraps over (ip -br addr on a compute node)
export GLOO_SOCKET_IFNAME="$NCCL_SOCKET_IFNAME"   # gloo groups (weight sync, engine TP control) use the same one
export NCCL_IB_HCA=rdma0,rdma1,rdma2,rdma3,rdma4,rdma5,rdma6,rdma7   # EDIT: the RDMA NICs, one per GPU (ibv_devinfo)
# export NCCL_IB_GID_INDEX=3             # EDIT: RoCE fabrics only: the GID of the RoCE v2 address (show_gids)
export NCCL_MIN_NCHANNELS=112            # more RCCL channels in end-to-end workloads (AMD's MI300X workload guide)
export TORCH_NCCL_HIGH_PRIORITY=1        # RCCL on high-priority streams: FSDP's communication overlaps its compute
export GPU_MAX_HW_QUEUES=2               # with the above: AMD finds 4 HIP streams or fewer best (2 compute, 2 RCCL)
export HIP_FORCE_DEV_KERNARG=1           # kernel arguments in device memory (default from ROCm 6.2; older stacks)
export HSA_OVERRIDE_CPU_AFFINITY_DEBUG=0   # ROCm helper threads keep the task's CPU binding instead of every core
# Torch extensions compiled at run time (torch.utils.cpp_extension) target these; set it to one chip to build faster.
export PYTORCH_ROCM_ARCH="${PYTORCH_ROCM_ARCH:-gfx942;gfx950}"
# export SGLANG_USE_AITER=1              # EDIT: SGLang's AITER kernels, where SGLang's venv has aiter (its ROCm image)
# Slurm binds GPUs through ROCR_VISIBLE_DEVICES (--gpus-per-task / --gpu-bind); an inherited HIP_VISIBLE_DEVICES would
# renumber them a second time inside each task.
unset HIP_VISIBLE_DEVICES
# Each task its own GPUs, the closest to its cores: the batch script adds --gpus-per-task=N --gpu-bind=$MILES_GPU_BIND
# to each srun (N = 1 for a trainer rank, engine_tp / engine_nodes for an engine task). EDIT to unset where the site's
# cgroups hide a task's peers and rccl-tests shows XGMI bandwidth lost.
export MILES_GPU_BIND=closest
# export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET   # debug a hang at the first collective
