"""Tensor-parallel inference: the leader (rank 0) and worker (rank 1) in lockstep."""
