"""The gRPC gateway: one door for operators and client programs."""
