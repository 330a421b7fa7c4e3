"""Launch: allocation plans for cells (local process groups or one heterogeneous Slurm job) and entry points."""
