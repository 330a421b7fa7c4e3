"""Local cells: leader processes (engine + trainer), their role switches and CPU quotas."""
