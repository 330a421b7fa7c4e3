"""Discrete-event simulator of a Gyre cluster driving the real scheduler policy on a virtual clock."""
