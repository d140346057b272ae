# Site file for NVIDIA GPU nodes on InfiniBand (sourced by the batch script: slurm.site). EDIT to the site's modules.

module load cuda                          # EDIT
export NCCL_SOCKET_IFNAME=ib0             # EDIT: bootstrap over the IB interface (ip -br link on a compute node)
export NCCL_IB_HCA=mlx5                   # EDIT: the HCAs NCCL may use (ibv_devinfo)
export NCCL_NVLS_ENABLE=0                 # NVLink SHARP needs IMEX channels that batch jobs often lack
# Per-task GPU binding (the batch script's srun then adds --gpus-per-task=N --gpu-bind=$MILES_GPU_BIND): each rank
# sees only its GPUs. Unset (the default here), every task sees its node's GPUs and takes its block by local rank,
# which keeps NVLink peer access between a node's ranks whatever the site's cgroup settings; measure before setting.
# export MILES_GPU_BIND=closest
# export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
