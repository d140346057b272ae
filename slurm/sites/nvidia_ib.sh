# Site file for NVIDIA GPU nodes on InfiniBand (sourced by the batch script: slurm.site). EDIT to the site's modules.

module load cuda                          # EDIT
export NCCL_SOCKET_IFNAME=ib0             # EDIT: bootstrap over the IB interface (ip -br link on a compute node)
export NCCL_IB_HCA=mlx5                   # EDIT: the HCAs NCCL may use (ibv_devinfo)
export NCCL_NVLS_ENABLE=0                 # NVLink SHARP needs IMEX channels that batch jobs often lack
# export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
