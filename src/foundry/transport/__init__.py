"""Drivers that move wire bytes over sockets and shared memory."""
