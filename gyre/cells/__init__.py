"""Cells: leader processes (engine + trainer), their role switches and CPU quotas, run as local
processes or as the tasks of a Slurm job (`placement`: where a task runs in it)."""
