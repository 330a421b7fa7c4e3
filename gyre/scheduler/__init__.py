"""Scheduler: the waterlevel policy that decides cell roles, the cell state machine, and staleness."""
