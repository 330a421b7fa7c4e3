"""Control plane: typed messages (`messages`) over one channel interface (`transport`), TCP or MPI."""
