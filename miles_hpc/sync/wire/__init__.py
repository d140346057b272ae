"""What crosses between trainer and engine: tensor checksums (`checksum`, `checksum_kernels`), tensor handles and
their restricted unpickler (`tensor_handles`), process groups over torch.distributed (`pg`) or MPI (`mpi`).
Imports nothing of ours outside this package (the engine and the trainer both use it)."""
