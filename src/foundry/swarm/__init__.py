"""Swarm training: the coordinator (parameter server) and its workers over FDTC."""
